"""Speech for the asr tests, synthesised at test time (hibari's bundled `heart` voice), and word error rate."""

from __future__ import annotations

import functools
import re

import numpy as np
from hibari import Hibari

from voice_server.audio import StreamResampler

SAMPLING_RATE = 16000
TTS_RATE = 24000
SENTENCES = (
    "please tell me the weather in london tomorrow morning",
    "i would like to book a table for two people tonight",
    "what time does the train leave for new york city",
)


@functools.cache
def _voice() -> Hibari:
    return Hibari(voice="heart")


@functools.cache
def _speech(text: str, silence_s: float) -> np.ndarray:
    resampler = StreamResampler(TTS_RATE, SAMPLING_RATE)
    audio = np.concatenate([resampler.process(_voice()(text)), resampler.flush()])[resampler.spec.delay_out:]
    silence = np.zeros(int(silence_s * SAMPLING_RATE), np.float32)
    speech = np.concatenate([silence, audio, silence]).astype(np.float32)
    speech.setflags(write=False)  # NOTE: cached and shared between tests
    return speech


def speech(text: str, silence_s: float = 0.3) -> np.ndarray:
    """`text` spoken, as float32 16 kHz mono, with `silence_s` of silence on each side."""
    return _speech(text, silence_s)


def chunks(audio: np.ndarray, chunk_ms: int = 20) -> list[np.ndarray]:
    step = SAMPLING_RATE * chunk_ms // 1000
    return [audio[i:i + step] for i in range(0, len(audio), step)]


def words(text: str) -> list[str]:
    return re.sub(r"[^a-z' ]", " ", text.lower()).split()


def word_error_rate(reference: str, hypothesis: str) -> float:
    """(substitutions + deletions + insertions) / reference words: a word-level Levenshtein distance."""
    ref, hyp = words(reference), words(hypothesis)
    if not ref:
        return float(len(hyp) > 0)
    row = list(range(len(hyp) + 1))
    for i, ref_word in enumerate(ref, 1):
        diagonal, row[0] = row[0], i
        for j, hyp_word in enumerate(hyp, 1):
            diagonal, row[j] = row[j], min(row[j] + 1, row[j - 1] + 1, diagonal + (ref_word != hyp_word))
    return row[-1] / len(ref)
