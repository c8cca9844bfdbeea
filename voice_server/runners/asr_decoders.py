"""A pool of PocketSphinx decoders: built and warmed at start-up, lent to one request at a time.

Building a decoder (acoustic model, 134k-word dictionary, trigram LM) takes ~0.25 s of CPU and
~90 MB of private memory, far too slow for the first-audio path, so the asr stage builds all of them
before it reports ready and a request only borrows one. Everything a decoder learns from an
utterance (its live cepstral mean) is reset when it is lent again, so a transcript does not depend
on which decoder, or which earlier speaker's audio, it got.

The models are the en-us acoustic model, `en-us.lm.bin` and `cmudict-en-us.dict` inside the
`pocketsphinx` wheel: nothing is downloaded.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
from pocketsphinx import Decoder, get_model_path

log = logging.getLogger(__name__)

SAMPLING_RATE = 16000
_WARM_UP_SAMPLES = SAMPLING_RATE // 2
"""Half a second of faint noise per decoder at start-up: the first utterance's allocations happen
then, not on a user's turn."""


@dataclass(frozen=True)
class DecoderOptions:
    is_fwdflat: bool = False
    """PocketSphinx's second, flat-lexicon search at the end of each utterance. Off by default: it adds
    ~50 ms to `end_utt` (on the first-audio path) for no measured gain in word error rate here."""

    def __post_init__(self) -> None:
        if not isinstance(self.is_fwdflat, bool):
            raise ValueError(f"DecoderOptions.is_fwdflat: must be a bool, got {self.is_fwdflat!r}")


def model_paths() -> dict[str, str]:
    """The en-us acoustic model, LM and dictionary shipped in the pocketsphinx wheel."""
    root = os.path.join(get_model_path(), "en-us")
    return {"hmm": os.path.join(root, "en-us"), "lm": os.path.join(root, "en-us.lm.bin"),
            "dict": os.path.join(root, "cmudict-en-us.dict")}


def build_decoder(options: DecoderOptions) -> Decoder:
    # NOTE: loglevel ERROR: at INFO PocketSphinx writes hundreds of lines per decoder to the stage's stderr.
    return Decoder(**model_paths(), samprate=SAMPLING_RATE, fwdflat=options.is_fwdflat, loglevel="ERROR")


class DecoderPool:
    """`num_decoders` decoders built at construction; `acquire` lends a free one (None when all are lent)."""

    def __init__(
        self, num_decoders: int, options: DecoderOptions | None = None, name: str = "asr",
        progress: Callable[[str], None] | None = None,
    ) -> None:
        """`progress` hears each start-up step (the stage's `ctx.progress`); by default they are logged."""
        if isinstance(num_decoders, bool) or not isinstance(num_decoders, int) or num_decoders < 1:
            raise ValueError(f"DecoderPool.num_decoders: must be an integer >= 1, got {num_decoders!r}")
        self.options = options or DecoderOptions()
        self.name = name
        report = progress or (lambda phase: log.info("stage %s: %s", name, phase))
        started = time.monotonic()
        self._free: list[Decoder] = []
        for index in range(num_decoders):
            report(f"building speech decoders ({index}/{num_decoders} ready, {time.monotonic() - started:.1f} s)")
            self._free.append(self._build())
        self.num_decoders = num_decoders
        self.load_s = time.monotonic() - started
        """Seconds it took to build and warm the whole pool."""
        self._initial_cmn = self._free[0].get_cmn(False)

    def _build(self) -> Decoder:
        decoder = build_decoder(self.options)
        noise = np.random.default_rng(0).normal(0.0, 30.0, _WARM_UP_SAMPLES).astype(np.int16)
        decoder.start_utt()
        decoder.process_raw(noise.tobytes(), False, False)
        decoder.end_utt()
        return decoder

    @property
    def num_free(self) -> int:
        return len(self._free)

    def acquire(self) -> Decoder | None:
        if not self._free:
            return None
        decoder = self._free.pop()
        self.reset(decoder)
        return decoder

    def reset(self, decoder: Decoder) -> None:
        """Forget what earlier utterances taught the decoder (between utterances only)."""
        # NOTE: live cepstral mean normalisation carries its estimate from one utterance to the next;
        # starting every utterance from the same estimate keeps transcripts independent of history.
        decoder.set_cmn(self._initial_cmn)

    def give_back(self, decoder: Decoder, is_in_utterance: bool) -> None:
        """Return a lent decoder; an utterance still open (an aborted stream) is ended first."""
        if is_in_utterance:
            try:
                decoder.end_utt()
            except RuntimeError:
                # NOTE: a decoder in an unknown state is not lent again; a new one takes its place.
                log.exception("stage %s: a speech decoder failed to end its utterance; building a new one",
                              self.name)
                decoder = self._build()
        self._free.append(decoder)
