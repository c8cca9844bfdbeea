"""One stage inside a stage process: its scheduler, its runner and the request bookkeeping the
shell needs to route outputs (open downstream streams, relay slots held per request)."""

from __future__ import annotations

import gc
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from voice_server.config import PipelineConfig, StageConfig
from voice_server.config.checks import resolve_factory
from voice_server.config.errors import fail, quoted, show
from voice_server.engine.messages import SlabRef
from voice_server.scheduling import SCHEDULER_BUILDERS, AnyRunner, AnyScheduler, Runner


@dataclass(frozen=True)
class StageContext:
    """What a stage factory receives."""

    stage: StageConfig
    pipeline: PipelineConfig
    budget_bytes: int | None
    """Memory this stage may use; None for GPUs until the stage resolves it with torch."""
    launch_id: str
    report: Callable[[str], None] | None = None
    """Sends a startup phase to the coordinator (set by the stage shell)."""

    @property
    def args(self) -> dict[str, Any]:
        return self.stage.factory_args

    def known_args(self, known: Sequence[str]) -> dict[str, Any]:
        """A copy of `factory_args`, refused with a ConfigError naming the first key not in `known`
        (a typo in a config must not be silently ignored)."""
        unknown = sorted(str(k) for k in self.args if k not in known)
        if unknown:
            raise fail(f"stage {quoted(self.stage.name)}", f"factory_args.{unknown[0]}",
                       f"unknown key; known: {', '.join(known)}")
        return dict(self.args)

    def progress(self, phase: str) -> None:
        """The factory's current startup step ("loading weights", "warming up"): logged, and shown
        by `/health` until the stage is ready, so a slow start says what it is doing."""
        logging.getLogger("voice_server.stage").info("stage %s: %s", self.stage.name, phase)
        if self.report is not None:
            self.report(phase[:80])

    def memory_budget_bytes(self) -> int:
        """`budget_bytes`, or for a GPU stage its `memory_fraction` of the device's memory (read here,
        in the stage process: the server process never imports torch)."""
        if self.budget_bytes is not None:
            return self.budget_bytes
        import torch

        total = torch.cuda.get_device_properties(torch.device(self.stage.device)).total_memory
        return int(total * self.stage.memory_fraction)


def create_scheduler(stage: StageConfig, runner: AnyRunner) -> AnyScheduler:
    build = SCHEDULER_BUILDERS.get(stage.scheduler)
    if build is None:
        # NOTE: validated names whose implementation has not landed yet.
        where = f"stage '{stage.name}': field 'scheduler'"
        raise NotImplementedError(f"{where}: '{stage.scheduler}' is not implemented yet")
    return build(stage, runner)


def create_runner(ctx: StageContext) -> AnyRunner:
    factory = resolve_factory(ctx.stage)
    runner = factory(ctx)
    # NOTE: checked here, at start-up, so a bad factory is a StartupFailed naming the stage instead
    # of a stage process that dies on its first request.
    if not isinstance(runner, Runner):
        raise TypeError(
            f"stage '{ctx.stage.name}': field 'factory': {ctx.stage.factory} returned {show(runner)}, "
            "which is not a voice_server.scheduling.Runner"
        )
    if ctx.report is not None:
        # NOTE: `report` is set by the stage shell only: this is a stage process, whose heap is the runner's.
        freeze_startup_heap()
    return runner


def freeze_startup_heap() -> None:
    """Collect once, then move every object alive into the collector's permanent generation.

    NOTE: what a stage loads at start-up (torch and model code, weights, tokenizers: most of its tracked
    objects) lives as long as the process, yet every full collection would walk it all again, as a pause of
    the step that happens to allocate past the threshold. Frozen objects are never scanned nor collected
    (vLLM does the same after loading its model); the collect first leaves start-up garbage out of it.
    Called after each runner is built, so a process of several stages freezes each one's heap as it loads.
    Pauses before and after: `loadtest/bench_gc.py`.
    """
    gc.collect()
    gc.freeze()


@dataclass
class StageRuntime:
    cfg: StageConfig
    scheduler: AnyScheduler
    runner: AnyRunner
    params: dict[str, dict[str, Any]] = field(default_factory=dict)
    """Request id -> the client's params, forwarded to downstream stages."""
    num_chunks_sent: dict[str, dict[str, int]] = field(default_factory=dict)
    """Request id -> downstream stage -> chunks sent (a key exists once its stream is open)."""
    held_refs: dict[str, list[SlabRef]] = field(default_factory=dict)
    """Request id -> relay slots this stage reads; acked when the request leaves the stage."""
    num_chunks_received: dict[str, int] = field(default_factory=dict)
    """Request id -> upstream stream chunks received so far (a gap fails the request)."""
    timings: dict[str, dict[str, float]] = field(default_factory=dict)
    """Request id -> first-output times of this stage and those upstream (`NewRequest.timings`)."""
    replicas: dict[str, dict[str, str]] = field(default_factory=dict)
    """Request id -> its replica plan (`NewRequest.replicas`), which routes its outputs; absent when empty."""

    def forget(self, request_id: str) -> list[SlabRef]:
        """The request left the stage: drop its state, return the relay slots to ack."""
        self.params.pop(request_id, None)
        self.num_chunks_sent.pop(request_id, None)
        self.num_chunks_received.pop(request_id, None)
        self.timings.pop(request_id, None)
        self.replicas.pop(request_id, None)
        self.runner.release(request_id)
        return self.held_refs.pop(request_id, [])
