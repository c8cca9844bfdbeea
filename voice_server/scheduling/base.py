"""The contract between a stage's scheduler, its compute (runner) and the process shell.

The shell loop is the same for every scheduler type:

    batch = scheduler.schedule(now)          # plain description of what to run, or None
    result = compute.execute(batch)          # the only place torch and devices live
    emits = scheduler.update(batch, result)  # bookkeeping; what to send where

Schedulers are plain Python: no torch, no sockets, testable with no model.
"""

from __future__ import annotations

import enum
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, Protocol


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


@dataclass(frozen=True)
class Emit:
    request_id: str
    kind: EmitKind
    payload: dict[str, Any] = field(default_factory=dict)
    message: str = ""

    @property
    def is_final(self) -> bool:
        return self.kind is not EmitKind.STREAM


class Compute(Protocol):
    """What a stage factory returns: runs batches on a device."""

    def execute(self, batch: Any) -> Any: ...

    def release(self, request_id: str) -> None:
        """Forget per-request state (request finished, failed or aborted)."""


class BaseScheduler(ABC):
    @abstractmethod
    def add(self, item: WorkItem, now: float) -> None:
        """Queue one inbox item (new request, chunk or end of stream) received at `now`."""

    @abstractmethod
    def abort(self, request_id: str) -> bool:
        """Drop every queued item of the request; True if the stage held it."""

    @abstractmethod
    def schedule(self, now: float) -> Any | None:
        """The next batch to execute, or None when nothing should run yet."""

    @abstractmethod
    def update(self, batch: Any, result: Any) -> list[Emit]:
        """Account for an executed batch; return the outputs to route."""

    @abstractmethod
    def fail(self, batch: Any, message: str) -> list[Emit]:
        """The batch raised: return one ERROR emit per request in it."""

    @abstractmethod
    def next_wakeup(self, now: float) -> float | None:
        """Seconds until `schedule` may return a batch (0 = now, None = only after new input)."""

    @property
    @abstractmethod
    def active_request_ids(self) -> set[str]:
        """Requests that entered this stage and have not left it."""
