"""What the asr runner needs of a speech engine: a pool of recognisers, each lent to one request at a time.

One runner (`asr_runner.py`) serves every engine, so input checks, message building, counters and the
payload contract live in one place; an engine only turns 16-bit PCM into words:
- PocketSphinx (`asr_decoders.py`) decodes while the user speaks and has a partial hypothesis;
- Whisper (`asr_whisper.py`) buffers the turn and transcribes it whole at its end (no partials).
"""

from __future__ import annotations

from typing import Protocol


class Recognizer(Protocol):
    """One utterance at a time: `start`, `feed` (any number of times), `finish`."""

    def start(self, is_narrowband: bool = False) -> None:
        """Begin an utterance, forgetting everything earlier utterances taught the recogniser;
        `is_narrowband`: its audio was captured at 8 kHz (a phone call), though it comes at 16 kHz."""

    def feed(self, pcm: bytes, is_whole: bool = False) -> None:
        """16-bit native-order 16 kHz mono samples (may be empty); `is_whole`: the utterance's only audio."""

    def partial(self) -> str | None:
        """The hypothesis of the utterance so far, or None for an engine that gives no partials."""

    def finish(self) -> str:
        """End the utterance and return its transcript ("" when nothing was recognised)."""

    def confident_text(self) -> str | None:
        """The words of the last finished utterance that the recogniser is sure of, in order, or None for
        an engine that gives no confidences (all its words count)."""

    def alternatives(self) -> list[str]:
        """Other hypotheses of the last finished utterance, most likely first, where its last word is
        unsure (else, and for an engine that gives none, empty)."""


class RecognizerPool(Protocol):
    """Recognisers built before the stage reports ready; `acquire` lends a free one (None when all are lent),
    `grow` builds and lends one more while the pool is under `max_decoders` (its memory budget)."""

    @property
    def num_decoders(self) -> int: ...

    @property
    def max_decoders(self) -> int: ...

    @property
    def num_free(self) -> int: ...

    def acquire(self, is_narrowband: bool = False) -> Recognizer | None:
        """A free recogniser for audio captured at 8 kHz (`is_narrowband`, a phone call) or at 16 kHz; an engine
        may have recognisers of its own for calls (PocketSphinx) or hear both alike (Whisper)."""

    def grow(self, is_narrowband: bool = False) -> Recognizer | None:
        """One more recogniser, lent at once; None at `max_decoders`. May take a while (a PocketSphinx decoder
        takes 0.3-0.9 s to build), so only for a turn that cannot wait longer."""

    def give_back(self, recognizer: Recognizer, is_in_utterance: bool) -> None:
        """Return a lent recogniser; an utterance still open (an aborted stream) is dropped first."""
