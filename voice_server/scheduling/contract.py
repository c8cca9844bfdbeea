"""Everything that crosses the scheduler/runner boundary, per scheduler type, in one file.

A scheduler's `schedule()` returns its batch type, the runner's `execute()` returns the matching
result type, and the scheduler's `update()` reads it back. All are frozen dataclasses of plain
Python values (no torch), so schedulers are tested with no model.

- `simple`: `SimpleBatch` -> `SimpleResult` (work items in, emits out; stateless per step).
- `ar`: `ARBatch` -> `ARResult` (a ragged batch of token chunks over a paged KV cache in, one
  sampled token per sampling sequence out). The runner describes its KV cache with `ARSpec`.
- `code2wav`: `Code2WavBatch` -> `Code2WavResult` (one chunk of code frames per stream in, the PCM
  that became final per stream out). The runner gives its sample rate in `Code2WavSpec`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields
from typing import Any

from voice_server.scheduling.base import Emit, WorkItem

# ---------------------------------------------------------------------------------------------
# simple
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class SimpleBatch:
    items: tuple[WorkItem, ...]
    """In arrival order, so one request's chunks stay ordered."""


@dataclass(frozen=True)
class SimpleResult:
    emits: tuple[Emit, ...]


# ---------------------------------------------------------------------------------------------
# ar
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ARSpec:
    """What an AR runner tells its scheduler once weights are loaded and the KV cache is sized."""

    num_pages: int
    page_size: int
    """Tokens per KV page."""
    max_model_len: int
    """Longest sequence (prompt + output) the model accepts."""
    eos_token_ids: tuple[int, ...] = ()
    """Stop tokens on by default (a request may turn them off with `ignore_eos`)."""
    is_prefix_cacheable: bool = True
    """Whether token ids alone determine the keys/values (false for a stage fed embeddings, e.g.
    the talker: the prefix cache is then off whatever the stage's `prefix_cache` says)."""

    def __post_init__(self) -> None:
        for name in ("num_pages", "page_size", "max_model_len"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"ARSpec.{name} must be an integer >= 1, got {value!r}")


_MAX_STOP_STRINGS = 16
_MAX_STOP_LEN = 256


@dataclass(frozen=True)
class SamplingParams:
    """Per-request sampling and stop conditions (`params["sampling"]` of a request)."""

    temperature: float = 0.0
    """0 = greedy (top_k/top_p/seed are then unused)."""
    top_k: int = 0
    """0 = off."""
    top_p: float = 1.0
    repetition_penalty: float = 1.0
    """1 = off; HF semantics over prompt and output tokens."""
    seed: int | None = None
    """Seeds this request's own generator: the same request gives the same tokens in any batch."""
    max_tokens: int = 256
    stop: tuple[str, ...] = ()
    """Stop strings: the output ends before the first match (the match is not returned)."""
    stop_token_ids: tuple[int, ...] = ()
    """Stop tokens besides the model's EOS ids (the stop token is returned, as with EOS)."""
    ignore_eos: bool = False
    max_sentences: int = 0
    """Speech guardrail: stop after this many complete sentences (0 = off). A sentence ends at `.`,
    `!` or `?` followed by whitespace, so "3.5" does not end one; the text after it is not returned."""
    stop_repeat_len: int = 0
    """Speech guardrail: stop when the last `stop_repeat_len` output tokens already occurred in the
    output in that order, i.e. the model started looping (0 = off)."""

    def __post_init__(self) -> None:
        def bad(name: str, rule: str) -> ValueError:
            return ValueError(f"params.sampling.{name}: {rule}, got {getattr(self, name)!r}")

        if not _is_number(self.temperature) or not 0.0 <= self.temperature <= 100.0:
            raise bad("temperature", "must be a number in [0, 100]")
        if not _is_int(self.top_k) or self.top_k < 0:
            raise bad("top_k", "must be an integer >= 0")
        if not _is_number(self.top_p) or not 0.0 < self.top_p <= 1.0:
            raise bad("top_p", "must be a number in (0, 1]")
        if not _is_number(self.repetition_penalty) or not 0.0 < self.repetition_penalty <= 100.0:
            raise bad("repetition_penalty", "must be a number in (0, 100]")
        if self.seed is not None and (not _is_int(self.seed) or not 0 <= self.seed < 2**63):
            raise bad("seed", "must be null or an integer in [0, 2**63)")
        if not _is_int(self.max_tokens) or self.max_tokens < 1:
            raise bad("max_tokens", "must be an integer >= 1")
        if not isinstance(self.stop, tuple) or len(self.stop) > _MAX_STOP_STRINGS or not all(
            isinstance(s, str) and 0 < len(s) <= _MAX_STOP_LEN for s in self.stop
        ):
            raise bad("stop", f"must be at most {_MAX_STOP_STRINGS} non-empty strings of <= {_MAX_STOP_LEN} chars")
        if not isinstance(self.stop_token_ids, tuple) or not all(
            _is_int(t) and t >= 0 for t in self.stop_token_ids
        ):
            raise bad("stop_token_ids", "must be a list of token ids")
        if not isinstance(self.ignore_eos, bool):
            raise bad("ignore_eos", "must be true or false")
        for name in ("max_sentences", "stop_repeat_len"):
            if not _is_int(getattr(self, name)) or not 0 <= getattr(self, name) <= 1024:
                raise bad(name, "must be an integer in [0, 1024]")

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0

    @classmethod
    def from_params(cls, params: dict[str, Any], defaults: SamplingParams | None = None) -> SamplingParams:
        """Read `params["sampling"]` over `defaults`; unknown keys are refused (a typo is an error)."""
        base = defaults or cls()
        raw = params.get("sampling", {})
        if raw is None:
            raw = {}
        if not isinstance(raw, dict):
            raise ValueError(f"params.sampling: must be a mapping, got {type(raw).__name__}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(str(k) for k in raw if k not in known)
        if unknown:
            raise ValueError(
                f"params.sampling: unknown field(s) {', '.join(unknown)}; known: {', '.join(sorted(known))}"
            )
        values = {f.name: getattr(base, f.name) for f in fields(cls)}
        for key, value in raw.items():
            # NOTE: msgpack gives lists; the dataclass keeps tuples so it stays hashable and frozen.
            values[key] = tuple(value) if key in ("stop", "stop_token_ids") and isinstance(value, list) else value
        return cls(**values)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return _is_int(value) or (isinstance(value, float) and math.isfinite(value))


@dataclass(frozen=True)
class ARSeq:
    """One request's part of a step: compute `token_ids` at positions `start_pos...`, writing
    their keys/values into the request's pages, and sample one token if `is_sampling`."""

    request_id: str
    token_ids: tuple[int, ...]
    """At least one token. A prefill chunk, the whole recomputed sequence after preemption, or the
    last sampled token in decode."""
    start_pos: int
    """Position of `token_ids[0]` = tokens of this request already in the KV cache."""
    page_ids: tuple[int, ...]
    """The request's page table: page `i` holds positions `[i * page_size, (i + 1) * page_size)`;
    it covers at least `start_pos + len(token_ids)` positions."""
    is_sampling: bool
    """This chunk ends at the request's last known token: sample the next one."""
    sampling: SamplingParams
    history: tuple[int, ...] = ()
    """Prompt and output ids so far, set only when sampling needs them (repetition penalty)."""
    turn_end_row: int | None = None
    """Index into `token_ids` of the user's last word (`Request.turn_end_pos`): the runner scores how likely
    the next token ends the user's message, and streams that with the request's first token."""


@dataclass(frozen=True)
class ARBatch:
    seqs: tuple[ARSeq, ...]

    @property
    def num_tokens(self) -> int:
        return sum(len(s.token_ids) for s in self.seqs)


@dataclass(frozen=True)
class SeqOutput:
    token_id: int | None
    """The sampled token (None when the sequence was not sampling this step)."""
    text: str = ""
    """Text that `token_id` completes (incremental detokenisation; may be "" mid-character)."""
    data: dict[str, Any] = field(default_factory=dict)
    """Extra per-step outputs streamed with the token (e.g. hidden states for a downstream stage)."""


@dataclass(frozen=True)
class ARResult:
    outputs: tuple[SeqOutput, ...]
    """One per `ARBatch.seqs`, in the same order."""


# ---------------------------------------------------------------------------------------------
# code2wav
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Code2WavSpec:
    """What a Code2Wav runner tells its scheduler once the model is loaded."""

    sample_rate: int
    """Of the PCM the runner returns (24000 for the released model)."""

    def __post_init__(self) -> None:
        if not _is_int(self.sample_rate) or self.sample_rate < 1:
            raise ValueError(f"Code2WavSpec.sample_rate must be an integer >= 1, got {self.sample_rate!r}")


@dataclass(frozen=True)
class Code2WavChunk:
    """Decode frames `[num_frames_before, num_frames_before + num_frames)` of one stream.

    The codes themselves stay in the runner (it kept each stream's frames at admission), so the
    scheduler handles only counts."""

    request_id: str
    num_frames_before: int
    """Frames of this stream already decoded (the runner checks its stream state agrees)."""
    num_frames: int
    """New frames; 0 only with `is_last` (a flush of the held-back lookahead samples, or an empty stream)."""
    is_last: bool

    def __post_init__(self) -> None:
        if not _is_int(self.num_frames_before) or self.num_frames_before < 0:
            raise ValueError(f"Code2WavChunk.num_frames_before must be an integer >= 0, got {self.num_frames_before!r}")
        if not _is_int(self.num_frames) or self.num_frames < (0 if self.is_last else 1):
            raise ValueError(f"Code2WavChunk.num_frames must be an integer >= {0 if self.is_last else 1}, "
                             f"got {self.num_frames!r}")

    @property
    def is_first(self) -> bool:
        return self.num_frames_before == 0


@dataclass(frozen=True)
class Code2WavBatch:
    chunks: tuple[Code2WavChunk, ...]
    """At most one chunk per stream (a stream's chunks run in order, one step each)."""

    def __post_init__(self) -> None:
        if not self.chunks:
            raise ValueError("Code2WavBatch has no chunks")
        if len({c.request_id for c in self.chunks}) != len(self.chunks):
            raise ValueError("Code2WavBatch holds two chunks of one stream")

    @property
    def num_frames(self) -> int:
        return sum(c.num_frames for c in self.chunks)


@dataclass(frozen=True)
class Code2WavOutput:
    pcm: Any
    """float32 tensor [num_samples] on the CPU; opaque to the scheduler, which only routes it."""
    num_samples: int


@dataclass(frozen=True)
class Code2WavResult:
    outputs: tuple[Code2WavOutput, ...]
    """One per `Code2WavBatch.chunks`, in the same order."""
