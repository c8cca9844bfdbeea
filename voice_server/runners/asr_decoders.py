"""A pool of PocketSphinx decoders (the asr stage's default engine): built and warmed at start-up, lent to
one request at a time as a `Recognizer` (`asr_recognizer.py`) that decodes while the user speaks.

Building a decoder (acoustic model, 134k-word dictionary, trigram LM) takes ~0.25 s of CPU and
~90 MB of private memory, far too slow for the first-audio path, so the asr stage builds all of them
before it reports ready and a request only borrows one. Everything a decoder learns from an
utterance (its live cepstral mean) is reset when it is lent again, so a transcript does not depend
on which decoder, or which earlier speaker's audio, it got.

A phone call's audio (8 kHz, nothing above 4 kHz) is heard by decoders of its own: the same model with its
Gaussians' means moved to where such audio puts speech (`NARROWBAND_MLLR`). The pool builds
`num_narrowband` of them beside the others; a turn that finds none of its kind free borrows the other kind
(heard worse, but at once: a turn waiting for a decoder is only decoded once it has one).

The models are the en-us acoustic model, `en-us.lm.bin` and `cmudict-en-us.dict` inside the
`pocketsphinx` wheel: nothing is downloaded.
"""

from __future__ import annotations

import itertools
import logging
import math
import os
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
from pocketsphinx import Decoder, get_model_path

from voice_server.runners.asr_recognizer import Recognizer

log = logging.getLogger(__name__)

SAMPLING_RATE = 16000
_WARM_UP_SAMPLES = SAMPLING_RATE // 2
"""Half a second of faint noise per decoder at start-up: the first utterance's allocations happen
then, not on a user's turn."""


SPEECH_CMN = "58.6,-3.3,-1.1,1.5,-3.2,-3.0,-0.7,4.7,-0.8,-1.6,-0.8,-0.2,0.4"
"""Where every utterance's live cepstral mean starts: the mean over whole utterances of speech (hibari-tts
sentences at -26, -20 and -14 dBFS, clean and in noise, none from the benchmark's set). The en-us model
was trained with per-utterance (batch) means; decoding live, PocketSphinx starts from its generic
`40,3,-1,0,...`, far from speech's, and misrecognises an utterance's first second while the mean
catches up: word error rate in noise 0.64 from there, 0.34 from this, clean 0.21 and 0.13, on the
turn-taking set (`loadtest/bench_asr.py`, docs/BENCHMARKS.md)."""

NARROWBAND_CMN = "49.7,29.0,-44.4,40.5,-27.4,-0.8,17.3,-23.3,25.6,-15.2,-0.6,11.4,-15.3"
"""The same mean over the same kind of sentences sent as a phone sends them: 8 kHz u-law, back up at 16 kHz.
The model's filterbank reaches 6.8 kHz and such audio has nothing above 4 kHz: its upper filters sit at
their floor, which shifts every cepstral coefficient (by up to 45). Live CMN removes that shift only once
its mean has caught up, long after a turn is over: from `SPEECH_CMN` "What is the capital of France?" was
heard as "what what". Word error rate on the turn-taking set from `SPEECH_CMN`: clean 0.96, in noise 0.95;
from this, 0.34 and 0.56 (16 kHz speech from `SPEECH_CMN`: 0.13 and 0.34; `loadtest/bench_asr.py --narrowband`)."""


NARROWBAND_MLLR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "asr_narrowband.mllr")
"""The en-us model adapted to phone audio: per feature stream (cepstra, deltas, double deltas), a 13 x 13
matrix, a bias and variance scales (PocketSphinx's MLLR file) that move each Gaussian's mean to where 8 kHz
audio puts it. A call's missing 4-7 kHz band moves every cepstral coefficient in a way that depends on the
others; the matrices are a least-squares fit of the same sentences' cepstra sent through a phone on those
sent as they are (hibari-tts sentences, none from the benchmark's set, clean and in noise; written by
`loadtest/fit_narrowband_mllr.py`). Word error rate on the turn-taking set's calls (five seeds), clean / in
noise: 0.34 / 0.54 from `NARROWBAND_CMN` alone, 0.16 / 0.52 with this (`loadtest/bench_asr.py --narrowband`;
16 kHz speech: 0.13 / 0.34). A diagonal transform (each coefficient scaled alone) gained nothing."""


MIN_WORD_POSTERIOR = 0.05
"""A word of the final hypothesis at least this probable (its lattice posterior) is one the recogniser is
sure of. Measured on the turn-taking set's backchannels and barge-ins: the words PocketSphinx makes of
"uh huh" or "right" ("at hand", "rates", "rights") come out at 0.006-0.043, a real barge-in's words at
0.06-1.0 (a short "wait" heard as "we'd": 0.06-0.14)."""


UNSURE_LAST_WORD_POSTERIOR = 0.6
"""A final hypothesis whose last word is less probable than this comes with its alternatives: the word
a sentence ends on is the one the end-of-turn rule reads, and PocketSphinx's language model, which scores
the utterance as a whole sentence, turns a hesitation's dangling "a" or "the" into "it" or "that" (at
0.25-0.53 on the turn-taking set's hesitations; a complete question's last word: 0.08-0.99, the
alternatives of none of them ending where a sentence cannot)."""
NUM_ALTERNATIVES = 10
"""N-best hypotheses looked at (~0.1-1.3 ms)."""


def _is_number(text: str) -> bool:
    try:
        return math.isfinite(float(text))
    except ValueError:
        return False


@dataclass(frozen=True)
class DecoderOptions:
    is_fwdflat: bool = False
    """PocketSphinx's second, flat-lexicon search at the end of each utterance. Off by default: it adds
    ~50 ms to `end_utt` (on the first-audio path) for no measured gain in word error rate here."""

    initial_cmn: str = SPEECH_CMN
    """Every utterance's starting cepstral mean (13 comma-separated numbers)..."""
    narrowband_cmn: str = NARROWBAND_CMN
    """...and that of an utterance captured at 8 kHz (`voice_server.audio.NARROWBAND_MAX_RATE`)."""
    narrowband_mllr: str = NARROWBAND_MLLR
    """The transform of the narrowband decoders' model ("": none, they are 16 kHz ones and calls are heard from
    the narrowband mean alone)."""
    max_hmms_per_frame: int = 3000
    """PocketSphinx's `maxhmmpf`: the search keeps at most this many active HMMs per frame. Its own default
    (30000) costs ~0.24 s of CPU per second of speech; 3000 about 0.12 s, for +0.02 word error rate in
    noise on the turn-taking set (`loadtest/bench_asr.py`, docs/BENCHMARKS.md), so a 2-vCPU host keeps
    up with twice as many people talking at once."""

    def __post_init__(self) -> None:
        if not isinstance(self.is_fwdflat, bool):
            raise ValueError(f"DecoderOptions.is_fwdflat: must be a bool, got {self.is_fwdflat!r}")
        for name in ("initial_cmn", "narrowband_cmn"):
            cmn = getattr(self, name)
            parts = cmn.split(",") if isinstance(cmn, str) else []
            if len(parts) != 13 or not all(_is_number(p) for p in parts):
                raise ValueError(f"DecoderOptions.{name}: must be 13 comma-separated numbers, got {cmn!r}")
        mllr = self.narrowband_mllr
        if not isinstance(mllr, str) or (mllr and not os.path.isfile(mllr)):
            raise ValueError(f"DecoderOptions.narrowband_mllr: must be an MLLR file's path or '', got {mllr!r}")
        value = self.max_hmms_per_frame
        if isinstance(value, bool) or not isinstance(value, int) or value < 100:
            raise ValueError(f"DecoderOptions.max_hmms_per_frame: must be an integer >= 100, got {value!r}")


def model_paths() -> dict[str, str]:
    """The en-us acoustic model, LM and dictionary shipped in the pocketsphinx wheel."""
    root = os.path.join(get_model_path(), "en-us")
    return {"hmm": os.path.join(root, "en-us"), "lm": os.path.join(root, "en-us.lm.bin"),
            "dict": os.path.join(root, "cmudict-en-us.dict")}


def build_decoder(options: DecoderOptions, is_narrowband: bool = False, **search: float | str) -> Decoder:
    """A decoder of `options` (`is_narrowband`: its model adapted to phone audio, `options.narrowband_mllr`);
    `search`: further PocketSphinx arguments as they are (`loadtest/bench_asr.py`)."""
    if is_narrowband and options.narrowband_mllr:
        search = {"mllr": options.narrowband_mllr, **search}
    # NOTE: loglevel ERROR: at INFO PocketSphinx writes hundreds of lines per decoder to the stage's stderr.
    return Decoder(**model_paths(), samprate=SAMPLING_RATE, fwdflat=options.is_fwdflat,
                   maxhmmpf=options.max_hmms_per_frame, loglevel="ERROR", **search)


class SphinxRecognizer:
    """One PocketSphinx decoder as a `Recognizer`: each chunk is decoded as it is fed."""

    def __init__(self, decoder: Decoder, options: DecoderOptions, is_narrowband: bool = False) -> None:
        self.decoder = decoder
        self.options = options
        self.is_narrowband = is_narrowband
        """Its model is the one adapted to phone audio (`build_decoder`)."""
        self._words: list[tuple[str, float]] | None = None
        """The last finished utterance's words and posteriors, once asked for (`_final_words`)."""

    def start(self, is_narrowband: bool = False) -> None:
        # NOTE: live cepstral mean normalisation carries its estimate from one utterance to the next, and
        # `set_cmn` sets the mean but not what the estimate had summed: what a decoder heard last (another
        # session's turn, or the pool's warm-up) moved the next turn's words, for 13 of the turn-taking set's 36
        # questions as a decoder's first turn. The feature module rebuilt (~0.1 ms) and the same starting mean
        # make every utterance's transcript its own audio's alone.
        options = self.options
        self.decoder.reinit_feat()
        self.decoder.set_cmn(options.narrowband_cmn if is_narrowband else options.initial_cmn)
        self.decoder.start_utt()
        self._words = None

    def feed(self, pcm: bytes, is_whole: bool = False) -> None:
        if pcm:  # NOTE: PocketSphinx refuses an empty buffer
            self.decoder.process_raw(pcm, False, is_whole)

    def partial(self) -> str:
        hyp = self.decoder.hyp()
        return hyp.hypstr if hyp is not None else ""

    def finish(self) -> str:
        self.decoder.end_utt()
        self._words = None
        return self.partial()

    def confident_text(self) -> str:
        return " ".join(word for word, prob in self._final_words() if prob >= MIN_WORD_POSTERIOR)

    def alternatives(self) -> list[str]:
        words = self._final_words()
        if not words or words[-1][1] >= UNSURE_LAST_WORD_POSTERIOR:
            return []
        text = self.partial()
        hypotheses = (hyp.hypstr for hyp in itertools.islice(self.decoder.nbest() or (), NUM_ALTERNATIVES + 1)
                      if hyp is not None)  # NOTE: its iterator can yield None
        return [h for h in dict.fromkeys(hypotheses) if h != text][:NUM_ALTERNATIVES]

    def _final_words(self) -> list[tuple[str, float]]:
        """The last finished utterance's words with their posteriors: walked once, and only when asked
        for (a streamed turn's end), not for a whole request's clips.

        NOTE: `seg` after `end_utt` walks the best path of the lattice, each word with its posterior
        (1-13 ms); fillers (<s>, <sil>, [NOISE]) are not words, and "to(2)" is the dictionary's second "to"."""
        if self._words is None:
            segments = self.decoder.seg() or ()  # NOTE: None: the utterance had no audio
            self._words = [(seg.word.split("(")[0], seg.prob) for seg in segments
                           if not seg.word.startswith(("<", "["))]
        return self._words


class DecoderPool:
    """`num_decoders` decoders for 16 kHz audio and `num_narrowband` for phone audio, built at construction;
    `acquire` lends a free one (None when all are lent), `grow` builds one more, up to `max_decoders` in all."""

    def __init__(
        self, num_decoders: int, options: DecoderOptions | None = None, name: str = "asr",
        progress: Callable[[str], None] | None = None, max_decoders: int | None = None, num_narrowband: int = 0,
    ) -> None:
        """`progress` hears each start-up step (the stage's `ctx.progress`); by default they are logged.
        `max_decoders` (default all those built: no growth) bounds `grow`."""
        if isinstance(num_decoders, bool) or not isinstance(num_decoders, int) or num_decoders < 1:
            raise ValueError(f"DecoderPool.num_decoders: must be an integer >= 1, got {num_decoders!r}")
        if isinstance(num_narrowband, bool) or not isinstance(num_narrowband, int) or num_narrowband < 0:
            raise ValueError(f"DecoderPool.num_narrowband: must be an integer >= 0, got {num_narrowband!r}")
        num_built = num_decoders + num_narrowband
        self.max_decoders = num_built if max_decoders is None else max(num_built, max_decoders)
        self.options = options or DecoderOptions()
        self.name = name
        report = progress or (lambda phase: log.info("stage %s: %s", name, phase))
        started = time.monotonic()
        self._free: dict[bool, list[SphinxRecognizer]] = {False: [], True: []}
        """Free decoders by `is_narrowband`."""
        for index in range(num_built):
            report(f"building speech decoders ({index}/{num_built} ready, {time.monotonic() - started:.1f} s)")
            is_narrowband = index >= num_decoders
            self._free[is_narrowband].append(self._build(is_narrowband))
        self.num_decoders = num_built
        self.load_s = time.monotonic() - started
        """Seconds it took to build and warm the whole pool."""

    def _build(self, is_narrowband: bool) -> SphinxRecognizer:
        """A new decoder of that band, warmed up, as a recogniser."""
        decoder = build_decoder(self.options, is_narrowband)
        noise = np.random.default_rng(0).normal(0.0, 30.0, _WARM_UP_SAMPLES).astype(np.int16)
        decoder.start_utt()
        decoder.process_raw(noise.tobytes(), False, False)
        decoder.end_utt()
        return SphinxRecognizer(decoder, self.options, is_narrowband)

    @property
    def num_free(self) -> int:
        return len(self._free[False]) + len(self._free[True])

    def acquire(self, is_narrowband: bool = False) -> SphinxRecognizer | None:
        """A free decoder for audio of that band, else one of the other band rather than none. Word error rate
        (`loadtest/bench_asr.py --narrowband`, seed 0, clean / in noise): a call on a 16 kHz decoder 0.34 / 0.56
        (as before there were narrowband decoders) against 0.21 / 0.53; 16 kHz speech on a narrowband decoder
        0.17 / 0.38 against 0.13 / 0.34."""
        free = self._free[is_narrowband] or self._free[not is_narrowband]
        return free.pop() if free else None

    def grow(self, is_narrowband: bool = False) -> SphinxRecognizer | None:
        if self.num_decoders >= self.max_decoders:
            return None
        started = time.monotonic()
        recognizer = self._build(is_narrowband)
        self.num_decoders += 1
        log.info("stage %s: built %s speech decoder %d of at most %d in %.2f s (every one was busy)", self.name,
                 "a narrowband" if is_narrowband else "a", self.num_decoders, self.max_decoders,
                 time.monotonic() - started)
        return recognizer

    def give_back(self, recognizer: Recognizer, is_in_utterance: bool) -> None:
        """Return a lent decoder; an utterance still open (an aborted stream) is ended first."""
        assert isinstance(recognizer, SphinxRecognizer)
        is_narrowband = recognizer.is_narrowband
        if is_in_utterance:
            try:
                recognizer.decoder.end_utt()
            except RuntimeError:
                # NOTE: a decoder in an unknown state is not lent again; a new one takes its place.
                log.exception("stage %s: a speech decoder failed to end its utterance; building a new one",
                              self.name)
                recognizer = self._build(is_narrowband)
        self._free[is_narrowband].append(recognizer)
