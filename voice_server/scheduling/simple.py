"""SimpleScheduler: get -> forward -> put, with optional batching up to `max_batch_size`.

For preprocessing, encoders and other stateless-per-step stages. The runner receives a
`SimpleBatch` of `WorkItem`s (in arrival order, so one request's chunks stay ordered) and returns
one `SimpleResult` of `Emit`s for the whole batch.

`is_first_output_urgent` (the runner's attribute of that name): the queued items of requests that have
emitted nothing yet are batched first, and alone, each request's in order; the rest keep arrival order.
For text to speech: a reply's first clause is what its listener is waiting for, while a reply already
speaking has its later clauses' text queued seconds ahead of its playout. With 8 replies at once on 2
vCPUs, in arrival order a reply's first clause waited behind the other replies' whole texts (the first
clause's audio 0.2-0.45 s after its first token; docs/BENCHMARKS.md).
"""

from __future__ import annotations

from collections import deque

from voice_server.scheduling.base import BaseScheduler, Emit, EmitKind, WorkItem, WorkKind
from voice_server.scheduling.contract import SimpleBatch, SimpleResult
from voice_server.scheduling.solo import SoloQueue


class SimpleScheduler(BaseScheduler[SimpleBatch, SimpleResult]):
    def __init__(self, max_batch_size: int, batch_window_s: float = 0.0, is_first_output_urgent: bool = False) -> None:
        if max_batch_size < 1:
            raise ValueError("max_batch_size must be >= 1")
        self.max_batch_size = max_batch_size
        self.batch_window_s = batch_window_s
        self.is_first_output_urgent = is_first_output_urgent
        self._started: set[str] = set()
        """Requests that have emitted a STREAM (only kept with `is_first_output_urgent`)."""
        self._queue: deque[tuple[float, WorkItem]] = deque()
        self._active: set[str] = set()
        self._solo: SoloQueue[list[WorkItem]] = SoloQueue(lambda items: items[0].request_id)
        """One-request batches to run first: the members of a batch that raised, retried alone."""

    def add(self, item: WorkItem, now: float) -> None:
        if item.kind is WorkKind.NEW:
            self._active.add(item.request_id)
        elif item.request_id not in self._active:
            return  # late chunk of a request that already left (aborted or failed)
        self._queue.append((now, item))

    def abort(self, request_id: str) -> bool:
        held = request_id in self._active
        self._forget(request_id)
        self._queue = deque(e for e in self._queue if e[1].request_id != request_id)
        self._solo.discard(request_id)
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
        solo = self._solo.pop()
        if solo is not None:
            return SimpleBatch(tuple(solo))
        urgent = self._urgent()
        if urgent:
            return self._take(urgent)
        wait = self.next_wakeup(now)
        if wait is None or wait > 0:
            return None
        num = min(self.max_batch_size, len(self._queue))
        return SimpleBatch(tuple(self._queue.popleft()[1] for _ in range(num)))

    def _urgent(self) -> set[str]:
        """The queued requests to serve first (`is_first_output_urgent`); empty when there are none."""
        if not self.is_first_output_urgent or len(self._started) >= len(self._active):
            return set()
        return {item.request_id for _, item in self._queue} - self._started

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
        return SimpleBatch(tuple(items))

    def _forget(self, request_id: str) -> None:
        self._active.discard(request_id)
        self._started.discard(request_id)

    def update(self, batch: SimpleBatch, result: SimpleResult) -> list[Emit]:
        emits = []
        for emit in result.emits:
            if emit.request_id not in self._active:
                continue  # aborted while the batch ran
            if emit.is_final:
                self._forget(emit.request_id)
                self._queue = deque(e for e in self._queue if e[1].request_id != emit.request_id)
            elif emit.kind is EmitKind.STREAM and self.is_first_output_urgent:
                self._started.add(emit.request_id)
            emits.append(emit)
        return emits

    def fail(self, batch: SimpleBatch, message: str) -> list[Emit]:
        by_request: dict[str, list[WorkItem]] = {}
        for item in batch.items:
            if item.request_id in self._active:
                by_request.setdefault(item.request_id, []).append(item)
        # NOTE: one bad input must not fail the requests batched with it (`SoloQueue`): each request's
        # items are retried alone, in order, before anything else; only one that fails alone errors.
        if self._solo.defer(list(by_request.values())):
            return []
        for request_id in by_request:
            self.abort(request_id)
        return [Emit(rid, EmitKind.ERROR, message=message) for rid in by_request]

    @property
    def active_request_ids(self) -> set[str]:
        return set(self._active)
