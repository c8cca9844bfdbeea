"""One stage inside a stage process: its scheduler, its compute and the request bookkeeping the
shell needs to route outputs (open downstream streams, relay slots held per request)."""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from typing import Any

from voice_server.config import PipelineConfig, StageConfig
from voice_server.relay.shm import ShmRef
from voice_server.scheduling import BaseScheduler, Compute, SimpleScheduler


@dataclass(frozen=True)
class StageContext:
    """What a stage factory receives."""

    stage: StageConfig
    pipeline: PipelineConfig
    budget_bytes: int | None
    """Memory this stage may use; None for GPUs until the stage resolves it with torch."""
    launch_id: str

    @property
    def args(self) -> dict[str, Any]:
        return self.stage.factory_args


def create_scheduler(stage: StageConfig) -> BaseScheduler:
    if stage.scheduler == "simple":
        return SimpleScheduler(stage.max_batch_size, stage.batch_window_ms / 1000.0)
    # NOTE: validated names whose implementation lands with the AR scheduling issue.
    raise NotImplementedError(f"stage '{stage.name}': scheduler '{stage.scheduler}' is not implemented yet")


def create_compute(ctx: StageContext) -> Compute:
    module_name, _, attr = ctx.stage.factory.partition(":")
    try:
        factory = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as exc:
        where = f"stage '{ctx.stage.name}': field 'factory'"
        raise ImportError(f"{where}: cannot import {ctx.stage.factory}: {exc}") from exc
    compute: Compute = factory(ctx)
    return compute


@dataclass
class StageRuntime:
    cfg: StageConfig
    scheduler: BaseScheduler
    compute: Compute
    params: dict[str, dict[str, Any]] = field(default_factory=dict)
    """Request id -> the client's params, forwarded to downstream stages."""
    num_chunks_sent: dict[str, dict[str, int]] = field(default_factory=dict)
    """Request id -> downstream stage -> chunks sent (a key exists once its stream is open)."""
    held_refs: dict[str, list[ShmRef]] = field(default_factory=dict)
    """Request id -> relay slots this stage reads; acked when the request leaves the stage."""
    num_chunks_received: dict[str, int] = field(default_factory=dict)
    """Request id -> upstream stream chunks received so far (a gap fails the request)."""

    def forget(self, request_id: str) -> list[ShmRef]:
        """The request left the stage: drop its state, return the relay slots to ack."""
        self.params.pop(request_id, None)
        self.num_chunks_sent.pop(request_id, None)
        self.num_chunks_received.pop(request_id, None)
        self.compute.release(request_id)
        return self.held_refs.pop(request_id, [])
