"""SimpleScheduler: get -> forward -> put, with optional batching up to `max_batch_size`.

For preprocessing, encoders and other stateless-per-step stages. The runner receives a
`SimpleBatch` of `WorkItem`s (in arrival order, so one request's chunks stay ordered) and returns
one `SimpleResult` of `Emit`s for the whole batch.

`urgency` (the runner's `urgency` attribute, `Urgency.ARRIVAL` without one): which requests a stage that is
behind serves first. Their queued items are batched before the rest, and alone, each request's in order:
- `ENDING`, speech recognition: the requests whose input has ended (their DONE is queued). Their result
  is what a caller waits for (the transcript at the end of a turn); streams still receiving input only
  fall a little further behind and catch up when they end. In arrival order each ending stream waited
  for every other stream's backlog: with 8 people talking at once on 2 vCPUs, a turn's transcript came
  0.9-1.5 s after its end.
- `FIRST_OUTPUT`, text to speech: the requests that have emitted nothing yet (a reply's first clause is
  what its listener waits for; its later clauses are seconds ahead of the playout).
"""

from __future__ import annotations

import enum
from collections import deque

from voice_server.scheduling.base import BaseScheduler, Emit, EmitKind, WorkItem, WorkKind
from voice_server.scheduling.contract import SimpleBatch, SimpleResult


class Urgency(enum.Enum):
    """Which requests a `SimpleScheduler` serves first (the module docstring)."""

    ARRIVAL = "arrival"
    ENDING = "ending"
    FIRST_OUTPUT = "first_output"


class SimpleScheduler(BaseScheduler[SimpleBatch, SimpleResult]):
    def __init__(self, max_batch_size: int, batch_window_s: float = 0.0,
                 urgency: Urgency = Urgency.ARRIVAL) -> None:
        if max_batch_size < 1:
            raise ValueError("max_batch_size must be >= 1")
        if not isinstance(urgency, Urgency):
            raise ValueError(f"urgency must be an Urgency, got {urgency!r}")
        self.max_batch_size = max_batch_size
        self.batch_window_s = batch_window_s
        self.urgency = urgency
        self._ending: set[str] = set()
        """Requests with their DONE queued."""
        self._started: set[str] = set()
        """Requests that have emitted an output."""
        self._queue: deque[tuple[float, WorkItem]] = deque()
        self._active: set[str] = set()
        self._solo: deque[list[WorkItem]] = deque()
        """One-request batches to run first: the members of a batch that raised, retried alone."""

    def add(self, item: WorkItem, now: float) -> None:
        if item.kind is WorkKind.NEW:
            self._active.add(item.request_id)
        elif item.request_id not in self._active:
            return  # late chunk of a request that already left (aborted or failed)
        self._queue.append((now, item))
        if item.kind is WorkKind.DONE and self.urgency is Urgency.ENDING:
            self._ending.add(item.request_id)

    def abort(self, request_id: str) -> bool:
        held = request_id in self._active
        self._forget(request_id)
        self._queue = deque(e for e in self._queue if e[1].request_id != request_id)
        self._solo = deque(b for b in self._solo if b[0].request_id != request_id)
        return held

    def next_wakeup(self, now: float) -> float | None:
        if self._solo:
            return 0.0
        if not self._queue:
            return None
        if len(self._queue) >= self.max_batch_size or self._urgent():
            return 0.0
        return max(0.0, self._queue[0][0] + self.batch_window_s - now)

    def schedule(self, now: float) -> SimpleBatch | None:
        if self._solo:
            return SimpleBatch(tuple(self._solo.popleft()))
        wait = self.next_wakeup(now)
        if wait is None or wait > 0:
            return None
        urgent = self._urgent()
        if urgent:
            return self._take(urgent)
        num = min(self.max_batch_size, len(self._queue))
        return SimpleBatch(tuple(self._queue.popleft()[1] for _ in range(num)))

    def _urgent(self) -> set[str]:
        """The requests to serve first (`urgency`); empty when none is, or none is queued."""
        if self.urgency is Urgency.ENDING:
            return self._ending
        if self.urgency is Urgency.FIRST_OUTPUT and len(self._started) < len(self._active):
            return {item.request_id for _, item in self._queue} - self._started
        return set()

    def _take(self, urgent: set[str]) -> SimpleBatch:
        """The first `max_batch_size` queued items of the `urgent` requests, in arrival order (each request's
        stay in order); the rest of the queue stays as it was."""
        items: list[WorkItem] = []
        rest: deque[tuple[float, WorkItem]] = deque()
        for entry in self._queue:
            if len(items) < self.max_batch_size and entry[1].request_id in urgent:
                items.append(entry[1])
            else:
                rest.append(entry)
        self._queue = rest
        self._ending.difference_update(item.request_id for item in items if item.kind is WorkKind.DONE)
        return SimpleBatch(tuple(items))

    def _forget(self, request_id: str) -> None:
        self._active.discard(request_id)
        self._ending.discard(request_id)
        self._started.discard(request_id)

    def update(self, batch: SimpleBatch, result: SimpleResult) -> list[Emit]:
        emits = []
        for emit in result.emits:
            if emit.request_id not in self._active:
                continue  # aborted while the batch ran
            if emit.is_final:
                self._forget(emit.request_id)
                self._queue = deque(e for e in self._queue if e[1].request_id != emit.request_id)
            elif emit.kind is EmitKind.STREAM:
                self._started.add(emit.request_id)
            emits.append(emit)
        return emits

    def fail(self, batch: SimpleBatch, message: str) -> list[Emit]:
        by_request: dict[str, list[WorkItem]] = {}
        for item in batch.items:
            if item.request_id in self._active:
                by_request.setdefault(item.request_id, []).append(item)
        if len(by_request) > 1:
            # NOTE: one bad input must not fail the requests batched with it: retry each alone, in
            # order, before anything else; only a request that fails on its own gets an error.
            self._solo.extendleft(reversed(list(by_request.values())))
            return []
        for request_id in by_request:
            self.abort(request_id)
        return [Emit(rid, EmitKind.ERROR, message=message) for rid in by_request]

    @property
    def active_request_ids(self) -> set[str]:
        return set(self._active)
