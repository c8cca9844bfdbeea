"""`TTSRunner`: the runner of a `talker` text-to-speech stage (`simple` scheduler) over a
`Synthesizer` (`synthesizers.py`: hibari-tts by default, or a Piper voice).

Input, per request: either a stream (a NEW with `is_stream` and an empty payload, CHUNKs of
`{"text": "<delta>", ...}` from an upstream `stream_to`, e.g. a text LLM's tokens, then DONE) or a
whole NEW `{"text": "..."}`. Other payload keys (an LLM chunk's `token_ids`) are ignored.
`admit` refuses, for that request alone, text that is not a string or a request longer in total
than `max_text_chars`.

Output: each clause (`clauses.py`) is synthesised as soon as the text completing it arrives, as one
STREAM `{"pcm": float32 [n], "sample_rate": <the engine's: hibari 24000, piper 22050>}`; the rest
of the text at the end of input; then RESULT `{"num_samples", "num_clauses"}`. No text goes out: the upstream stage
sends the transcript. Each clause's audio is its sentences with the engine's silences trimmed, after
the pause owed to the clause before (`speech_edges.py`): the first clause speaks at once, the last
ends when its speech does.

Each request draws the engine's noise from its own generator seeded with `seed`, so (with hibari,
whose noise that is) a text gives the same audio whether it arrives whole or in deltas, alone or
batched.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from voice_server.runners.clauses import ClauseRules, ClauseSplitter
from voice_server.runners.speech_edges import EdgeRules, join_sentences, pause_after
from voice_server.runners.synthesizers import Synthesizer
from voice_server.scheduling import (
    AdmissionError,
    Emit,
    EmitKind,
    Runner,
    SimpleBatch,
    SimpleResult,
    WorkItem,
    WorkKind,
)

log = logging.getLogger(__name__)

WARM_UP_TEXT = "Warming up, zorblax."
"""Loads the lazy parts of the engine: hibari's G2P lexicons and tagger, and (an unknown word) its
out-of-vocabulary net, otherwise the first request's first clause pays ~0.4 s for them; piper's
espeak-ng data and onnxruntime's first-run allocations."""


@dataclass(frozen=True)
class TTSRunnerConfig:
    speed: float = 1.0
    """Speaking rate, 0.5 (slow) .. 2.0 (fast); 1.0 is the voice's own pace."""
    seed: int = 0
    """Seeds each request's noise generator."""
    max_text_chars: int = 32768
    """Most characters one request may bring in total (an LLM reply of thousands of tokens fits)."""
    clauses: ClauseRules = ClauseRules()
    edges: EdgeRules = EdgeRules()

    def __post_init__(self) -> None:
        speed = self.speed
        if isinstance(speed, bool) or not isinstance(speed, int | float) or not 0.5 <= speed <= 2.0:
            raise ValueError(f"TTSRunnerConfig.speed must be a number in [0.5, 2.0], got {speed!r}")
        for name in ("seed", "max_text_chars"):
            value = getattr(self, name)
            minimum = 0 if name == "seed" else 1
            if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
                raise ValueError(f"TTSRunnerConfig.{name} must be an integer >= {minimum}, got {value!r}")
        for name, kind in (("clauses", ClauseRules), ("edges", EdgeRules)):
            if not isinstance(getattr(self, name), kind):
                raise ValueError(f"TTSRunnerConfig.{name} must be a {kind.__name__}, got {getattr(self, name)!r}")


@dataclass
class _Speech:
    """One request's state between its items."""

    splitter: ClauseSplitter
    rng: np.random.Generator
    num_chars: int = 0
    """Text admitted so far (capped by `max_text_chars`)."""
    num_samples: int = 0
    num_clauses: int = 0
    pause_ms: int = 0
    """Silence owed before the next clause's audio (the pause after the last clause that spoke)."""


class TTSRunner(Runner[SimpleBatch, SimpleResult]):
    is_first_output_urgent = True
    """A reply's first clause is what its listener waits for; the later ones are ahead of the playout."""

    def __init__(self, engine: Synthesizer, config: TTSRunnerConfig | None = None) -> None:
        rate = engine.sample_rate
        if isinstance(rate, bool) or not isinstance(rate, int) or not 8000 <= rate <= 48000:
            raise ValueError(f"TTSRunner: the engine's sample rate must be an integer in [8000, 48000], got {rate!r}")
        self.engine = engine
        self.sample_rate = rate
        self.config = config or TTSRunnerConfig()
        self._speech: dict[str, _Speech] = {}

    def warm_up(self) -> float:
        """Synthesise `WARM_UP_TEXT` once (see its note); returns the seconds it took."""
        start = time.perf_counter()
        pcm = self._synthesize(WARM_UP_TEXT, np.random.default_rng(0))
        if pcm.size == 0:
            raise RuntimeError("TTSRunner: the warm-up text gave no audio")
        return time.perf_counter() - start

    # -- admission -------------------------------------------------------------------------------

    def admit(self, item: WorkItem) -> WorkItem:
        if item.kind is WorkKind.DONE:
            return item
        rid = item.request_id
        if not isinstance(item.payload, dict):
            raise AdmissionError(f"payload: must be a mapping, got {type(item.payload).__name__}")
        if item.kind is WorkKind.NEW:
            speech = _Speech(ClauseSplitter(self.config.clauses), np.random.default_rng(self.config.seed))
            self._speech[rid] = speech
            if item.is_stream and "text" not in item.payload:
                return dataclasses.replace(item, payload={"text": ""})  # NOTE: the text comes in chunks
            where = "payload.text"
        else:
            found = self._speech.get(rid)
            if found is None:
                raise AdmissionError(f"request {rid}: text before the request opened")
            speech, where = found, "chunk payload.text"
        if "text" not in item.payload:
            raise AdmissionError(f"{where}: missing (this stage speaks text)")
        text = item.payload["text"]
        if not isinstance(text, str):
            raise AdmissionError(f"{where}: must be a string, got {type(text).__name__}")
        speech.num_chars += len(text)
        if speech.num_chars > self.config.max_text_chars:
            raise AdmissionError(f"{where}: the request's text exceeds {self.config.max_text_chars} characters "
                                 "(max_text_chars)")
        return dataclasses.replace(item, payload={"text": text})

    def release(self, request_id: str) -> None:
        self._speech.pop(request_id, None)

    # -- execution -------------------------------------------------------------------------------

    def execute(self, batch: SimpleBatch) -> SimpleResult:
        emits: list[Emit] = []
        failed: set[str] = set()
        for item in batch.items:
            rid = item.request_id
            speech = self._speech.get(rid)
            if rid in failed or speech is None:
                continue  # NOTE: released (aborted) while queued, or failed earlier in this batch
            try:
                emits.extend(self._step(rid, speech, item))
            except Exception as exc:
                # NOTE: fail this request alone and keep going: its splitter already took the text,
                # so letting the batch raise (and the scheduler re-run it) would feed it twice.
                log.exception("request %s: synthesis failed", rid)
                emits.append(Emit(rid, EmitKind.ERROR, message=f"synthesis failed: {type(exc).__name__}: {exc}"))
                failed.add(rid)
        return SimpleResult(tuple(emits))

    def _step(self, rid: str, speech: _Speech, item: WorkItem) -> list[Emit]:
        is_last = item.kind is WorkKind.DONE or (item.kind is WorkKind.NEW and not item.is_stream)
        clauses = speech.splitter.feed(item.payload.get("text", ""))
        if is_last:
            clauses.extend(speech.splitter.flush())
        emits = []
        for clause in clauses:
            pcm = self._synthesize(clause, speech.rng, speech.pause_ms)
            speech.num_clauses += 1
            if pcm.size:
                speech.pause_ms = pause_after(clause, self.config.edges)
                speech.num_samples += int(pcm.size)
                emits.append(Emit(rid, EmitKind.STREAM, {"pcm": pcm, "sample_rate": self.sample_rate}))
        if is_last:
            emits.append(Emit(rid, EmitKind.RESULT, {"num_samples": speech.num_samples,
                                                     "num_clauses": speech.num_clauses}))
        return emits

    def _synthesize(self, text: str, rng: np.random.Generator, lead_ms: int = 0) -> npt.NDArray[np.float32]:
        """One clause -> float32 PCM, `lead_ms` of pause first (the engine splits a clause of several
        sentences itself; their joins get the sentence pause)."""
        sentences = self.engine.synthesize(text, float(self.config.speed), rng)
        return join_sentences(sentences, self.sample_rate, self.config.edges, lead_ms)
