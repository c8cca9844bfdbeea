"""One stage's scheduler and runner driven in this process, with no sockets: the same
`admit -> add -> schedule -> execute -> update` loop as the stage shell, for offline generation,
benchmarks and reference drivers (so there is one generation loop: the runner under its scheduler).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from voice_server.scheduling import AnyRunner, AnyScheduler, Emit, EmitKind, WorkItem, WorkKind


@dataclass(frozen=True)
class LocalRequest:
    request_id: str
    payload: dict[str, Any]
    params: dict[str, Any] = field(default_factory=dict)
    arrival_step: int = 0
    """Admit the request before this step (0 = at once): staggered arrivals."""


@dataclass
class LocalOutcome:
    emits: list[Emit] = field(default_factory=list)
    error: str | None = None
    first_emit_s: float | None = None
    """Seconds from the request's admission to its first emit (time to first token)."""

    @property
    def result(self) -> dict[str, Any]:
        final = self.emits[-1] if self.emits else None
        if final is None or final.kind is not EmitKind.RESULT:
            raise RuntimeError(f"request did not finish: {self.error or 'no result'}")
        return final.payload


class LocalStage:
    def __init__(self, scheduler: AnyScheduler, runner: AnyRunner) -> None:
        self.scheduler = scheduler
        self.runner = runner
        self.num_steps = 0

    def run(
        self, requests: Iterable[LocalRequest], on_step: Callable[[LocalStage], None] | None = None,
    ) -> dict[str, LocalOutcome]:
        """Run every request to its end; `on_step` is called after each step (e.g. to abort)."""
        pending = sorted(requests, key=lambda r: r.arrival_step)
        outcomes: dict[str, LocalOutcome] = {r.request_id: LocalOutcome() for r in pending}
        admitted_at: dict[str, float] = {}
        step = 0
        while pending or self.scheduler.active_request_ids:
            while pending and pending[0].arrival_step <= step:
                request = pending.pop(0)
                admitted_at[request.request_id] = time.perf_counter()
                self._admit(request, outcomes[request.request_id])
            batch = self.scheduler.schedule(time.monotonic())
            if batch is None:
                if not pending:
                    break  # NOTE: nothing runnable and nothing to come: a scheduler that holds requests idle
                step += 1
                continue
            try:
                result = self.runner.execute(batch)
            except Exception as exc:
                emits = self.scheduler.fail(batch, f"{type(exc).__name__}: {exc}")
            else:
                emits = self.scheduler.update(batch, result)
            now = time.perf_counter()
            for emit in emits:
                outcome = outcomes[emit.request_id]
                if outcome.first_emit_s is None:
                    outcome.first_emit_s = now - admitted_at[emit.request_id]
                outcome.emits.append(emit)
                if emit.kind is EmitKind.ERROR:
                    outcome.error = emit.message
                if emit.is_final:
                    self.runner.release(emit.request_id)
            self.num_steps += 1
            step += 1
            if on_step is not None:
                on_step(self)
        return outcomes

    def abort(self, request_id: str) -> None:
        self.scheduler.abort(request_id)
        self.runner.release(request_id)

    def _admit(self, request: LocalRequest, outcome: LocalOutcome) -> None:
        item = WorkItem(request.request_id, WorkKind.NEW, request.payload, request.params)
        try:
            self.scheduler.add(self.runner.admit(item), time.monotonic())
        except ValueError as exc:
            outcome.error = f"refused: {exc}"
