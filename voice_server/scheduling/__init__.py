"""Schedulers: plain Python (no torch, no sockets); see base.py for the contract with the shell."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from voice_server.scheduling.base import BaseScheduler, Compute, Emit, EmitKind, WorkItem, WorkKind
from voice_server.scheduling.simple import SimpleScheduler

if TYPE_CHECKING:
    from voice_server.config import StageConfig


def _build_simple(stage: StageConfig) -> BaseScheduler:
    return SimpleScheduler(stage.max_batch_size, stage.batch_window_ms / 1000.0)


SCHEDULER_BUILDERS: dict[str, Callable[[StageConfig], BaseScheduler]] = {"simple": _build_simple}
"""Implemented scheduler types by config name: the single source of truth for `create_scheduler` (which
builds from it) and `check-config` (which refuses the rest). A config may name a type that is valid but not
yet here (`config.pipeline.SCHEDULERS`: `ar`, `code2wav`); it becomes usable when its builder is added."""

__all__ = [
    "SCHEDULER_BUILDERS",
    "BaseScheduler",
    "Compute",
    "Emit",
    "EmitKind",
    "SimpleScheduler",
    "WorkItem",
    "WorkKind",
]
