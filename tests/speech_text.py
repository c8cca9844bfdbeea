"""Speech <-> text for tests: speech synthesised at test time (hibari's bundled `heart` voice), word
error rate, and a pocketsphinx transcriber (en-us model bundled with the `pocketsphinx` package) that
reads any supported sample rate.

    transcript = transcribe(pcm, 24000)
    assert word_error_rate("Hello there.", transcript) <= 0.35
"""

from __future__ import annotations

import functools
import re
from typing import Any

import numpy as np
import numpy.typing as npt

from voice_server.audio import StreamResampler, pcm16_to_float32, resample_signal, ulaw_decode, ulaw_encode
from voice_server.audio.pcm import float32_to_pcm16

ASR_RATE = 16000
"""The bundled en-us acoustic model's rate."""
TTS_RATE = 24000
SENTENCES = (
    "please tell me the weather in london tomorrow morning",
    "i would like to book a table for two people tonight",
    "what time does the train leave for new york city",
)
_NOT_WORD = re.compile(r"[^a-z0-9' ]+")


_ONES = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten", "eleven",
         "twelve", "thirteen", "fourteen", "fifteen", "sixteen", "seventeen", "eighteen", "nineteen"]
_TENS = ["_", "_", "twenty", "thirty", "forty", "fifty", "sixty", "seventy", "eighty", "ninety"]


def _spoken_number(word: str) -> list[str]:
    """Digits as a voice says them ("8" -> eight, "42" -> forty two); other words unchanged."""
    if not word.isdigit() or int(word) > 99:
        return [word]
    value = int(word)
    if value < 20:
        return [_ONES[value]]
    return [_TENS[value // 10]] + ([_ONES[value % 10]] if value % 10 else [])


def normalize_words(text: str) -> list[str]:
    """Lowercased words without punctuation (hyphens and dashes separate words; apostrophes stay), and
    numbers below 100 as words (a text's "8" is spoken, and heard, as "eight")."""
    text = text.lower().replace("’", "'").replace("-", " ").replace("—", " ").replace("–", " ")
    words = [w.strip("'") for w in _NOT_WORD.sub(" ", text).split() if w.strip("'")]
    return [spoken for word in words for spoken in _spoken_number(word)]


def word_error_rate(reference: str, hypothesis: str) -> float:
    """(substitutions + deletions + insertions) / reference words, over `normalize_words`."""
    ref, hyp = normalize_words(reference), normalize_words(hypothesis)
    if not ref:
        return 0.0 if not hyp else 1.0
    previous = list(range(len(hyp) + 1))
    for i, ref_word in enumerate(ref, 1):
        current = [i]
        for j, hyp_word in enumerate(hyp, 1):
            current.append(min(previous[j] + 1, current[j - 1] + 1, previous[j - 1] + (ref_word != hyp_word)))
        previous = current
    return previous[-1] / len(ref)


@functools.lru_cache(maxsize=1)
def _decoder() -> Any:
    from pocketsphinx import Decoder

    # NOTE: loaded once per process (~0.25 s); quiet, or it logs every utterance at INFO.
    return Decoder(samprate=ASR_RATE, loglevel="FATAL")


def to_asr_rate(pcm: npt.NDArray[np.floating], sample_rate: int) -> npt.NDArray[np.float32]:
    """`pcm` at 16 kHz, resampled as a stream (the way a server's ASR stage would receive it)."""
    samples = np.asarray(pcm, dtype=np.float32)
    if sample_rate == ASR_RATE:
        return samples
    resampler = StreamResampler(sample_rate, ASR_RATE)
    return np.concatenate([resampler.process(samples), resampler.flush()])


def transcribe(pcm: npt.NDArray[np.floating], sample_rate: int) -> str:
    """One utterance of float PCM (any rate `StreamResampler` supports) -> lowercase words."""
    decoder = _decoder()
    decoder.start_utt()
    decoder.process_raw(float32_to_pcm16(to_asr_rate(pcm, sample_rate)).tobytes(), full_utt=True)
    decoder.end_utt()
    hyp = decoder.hyp()
    return hyp.hypstr if hyp is not None else ""


@functools.cache
def _voice() -> Any:
    from hibari import Hibari

    return Hibari(voice="heart")


@functools.cache
def _speech(text: str, silence_s: float) -> npt.NDArray[np.float32]:
    resampler = StreamResampler(TTS_RATE, ASR_RATE)
    audio = np.concatenate([resampler.process(_voice()(text)), resampler.flush()])[resampler.spec.delay_out:]
    silence = np.zeros(int(silence_s * ASR_RATE), np.float32)
    speech = np.concatenate([silence, audio, silence]).astype(np.float32)
    speech.setflags(write=False)  # NOTE: cached and shared between tests
    return speech


def speech(text: str, silence_s: float = 0.3) -> npt.NDArray[np.float32]:
    """`text` spoken, as float32 16 kHz mono, with `silence_s` of silence on each side."""
    return _speech(text, silence_s)


def hesitant_speech(text: str, pause_s: float, silence_s: float = 0.3) -> npt.NDArray[np.float32]:
    """`text` (with a comma where the speaker hesitates) spoken with a `pause_s` silence at the comma: the
    voice's own pause there (the longest quiet stretch inside the speech, its first half said with a
    continuing contour, as a person who is not done) stretched to `pause_s`."""
    from voice_server.audio import frame_levels_db

    audio = speech(text, silence_s)
    is_loud = frame_levels_db(audio, ASR_RATE) >= -40.0
    loud = np.flatnonzero(is_loud)
    gaps = [(int(a) + 1, int(b)) for a, b in zip(loud[:-1], loud[1:], strict=True) if b - a > 1]
    start, end = max(gaps, key=lambda gap: gap[1] - gap[0])
    frame = ASR_RATE // 100
    cut = np.concatenate([audio[: start * frame], np.zeros(int(pause_s * ASR_RATE), np.float32), audio[end * frame:]])
    return cut.astype(np.float32)


def chunks(audio: npt.NDArray[np.float32], chunk_ms: int = 20) -> list[npt.NDArray[np.float32]]:
    step = ASR_RATE * chunk_ms // 1000
    return [audio[i:i + step] for i in range(0, len(audio), step)]


PHONE_RATE = 8000


def ulaw_of(signal_16k: npt.NDArray[np.floating]) -> bytes:
    """16 kHz float audio as a phone line carries it: band-limited to 8 kHz, mu-law."""
    return ulaw_encode(float32_to_pcm16(resample_signal(signal_16k, ASR_RATE, PHONE_RATE))).tobytes()


def by_phone(audio: npt.NDArray[np.float32]) -> npt.NDArray[np.float32]:
    """16 kHz `audio` as a phone call brings it to the recogniser: `ulaw_of`, then 16 kHz again as a session
    resamples it (nothing above 4 kHz)."""
    codes = np.frombuffer(ulaw_of(audio), np.uint8)
    return StreamResampler(PHONE_RATE, ASR_RATE).process(pcm16_to_float32(ulaw_decode(codes)))
