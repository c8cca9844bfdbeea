"""The contract between a stage's scheduler, its runner and the process shell.

The shell loop is the same for every scheduler type:

    item = runner.admit(item)                # validate/convert a request's input; raise to refuse it
    scheduler.add(item, now)                 # queue it (raises ValueError to refuse it)
    batch = scheduler.schedule(now)          # typed description of what to run, or None
    result = runner.execute(batch)           # the only place torch and devices live
    (the shell drains aborts here, so an aborted request's step output is dropped)
    emits = scheduler.update(batch, result)  # bookkeeping; what to send where

Schedulers are plain Python: no torch, no sockets, testable with no model. Each scheduler type
has its own typed batch and result (`contract.py`); `BaseScheduler[BatchT, ResultT]` and
`Runner[BatchT, ResultT]` pair them.
"""

from __future__ import annotations

import enum
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

BatchT = TypeVar("BatchT")
ResultT = TypeVar("ResultT")


class WorkKind(enum.Enum):
    NEW = "new"
    """A new request; `payload` is the upstream result (or the client's input at the entry)."""
    CHUNK = "chunk"
    """One stream chunk from an upstream stage, in order."""
    DONE = "done"
    """The upstream stream of this request has ended."""


class EmitKind(enum.Enum):
    STREAM = "stream"
    RESULT = "result"
    """The request's last output from this stage; it leaves the stage."""
    ERROR = "error"
    """The request failed in this stage; it leaves the stage."""


@dataclass
class WorkItem:
    request_id: str
    kind: WorkKind
    payload: dict[str, Any] = field(default_factory=dict)
    params: dict[str, Any] = field(default_factory=dict)
    seq: int = 0
    is_stream: bool = False
    """NEW only: the input arrives as CHUNKs until DONE (an upstream `stream_to`), rather than
    whole in `payload` (the client's input or an upstream `next` result)."""


@dataclass(frozen=True)
class Emit:
    request_id: str
    kind: EmitKind
    payload: dict[str, Any] = field(default_factory=dict)
    message: str = ""

    @property
    def is_final(self) -> bool:
        return self.kind is not EmitKind.STREAM


class AdmissionError(ValueError):
    """A request's input or params are malformed: it is refused, alone, with this message."""


class CapacityError(AdmissionError):
    """The stage has no room for one more request (e.g. every speech decoder is lent): it is refused,
    alone, as a retryable overload (the client gets an OverloadError)."""


class Runner(ABC, Generic[BatchT, ResultT]):
    """What a stage factory returns: the stage's torch side. Runs typed batches on a device."""

    next_only_keys: frozenset[str] = frozenset()
    """Keys of its outputs for the `next` stage only, left out of what a terminal stage sends the client
    (e.g. the conversation the asr stage hands the thinker, which the client already has). `_`-keys never
    reach the client either (streamed to `stream_to` stages only)."""

    is_first_output_urgent: bool = False
    """Under the `simple` scheduler: requests that have emitted nothing yet are served before the rest
    (`SimpleScheduler`); a talker's, whose first output is what a listener waits for."""

    def admit(self, item: WorkItem) -> WorkItem:
        """Check and convert one inbox item before the scheduler sees it (e.g. messages -> token
        ids). Raise `AdmissionError` (or `ValueError`) to refuse the request alone."""
        return item

    @abstractmethod
    def execute(self, batch: BatchT) -> ResultT:
        """Run one batch. Raising fails the requests in this batch (see `BaseScheduler.fail`)."""

    def release(self, request_id: str) -> None:  # noqa: B027 - optional hook, most runners keep no state
        """Forget per-request state (request finished, failed or aborted)."""

    def stats(self) -> dict[str, int]:
        """Counters for the stage's stats reply, next to its scheduler's (e.g. free decoders); empty by default."""
        return {}

    def facts(self) -> dict[str, bool | int | str]:
        """What the runner settled at start-up that an operator should see (e.g. `batch_invariant`): sent
        with the stage process's Ready and shown under the stage in `/health`; empty by default."""
        return {}


class BaseScheduler(ABC, Generic[BatchT, ResultT]):
    @abstractmethod
    def add(self, item: WorkItem, now: float) -> None:
        """Queue one inbox item (new request, chunk or end of stream) received at `now`.
        Raise `ValueError` to refuse the request (the shell fails it alone)."""

    @abstractmethod
    def abort(self, request_id: str) -> bool:
        """Drop the request and everything it holds (queued items, pages); True if it was held."""

    @abstractmethod
    def schedule(self, now: float) -> BatchT | None:
        """The next batch to execute, or None when nothing should run yet."""

    @abstractmethod
    def update(self, batch: BatchT, result: ResultT) -> list[Emit]:
        """Account for an executed batch; return the outputs to route. Requests aborted while the
        batch ran are gone from the scheduler: their part of the result is dropped."""

    @abstractmethod
    def fail(self, batch: BatchT, message: str) -> list[Emit]:
        """The batch raised: return ERROR emits for the requests that fail because of it."""

    @abstractmethod
    def next_wakeup(self, now: float) -> float | None:
        """Seconds until `schedule` may return a batch (0 = now, None = only after new input)."""

    @property
    @abstractmethod
    def active_request_ids(self) -> set[str]:
        """Requests that entered this stage and have not left it."""

    def stats(self) -> dict[str, int]:
        """Counters for the stage's stats reply (pages, queues); empty by default."""
        return {}
