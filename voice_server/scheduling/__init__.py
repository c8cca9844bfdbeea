"""Schedulers: plain Python (no torch, no sockets); see base.py for the contract with the shell
and contract.py for what crosses the scheduler/runner boundary per scheduler type."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from voice_server.config.errors import fail
from voice_server.scheduling.ar import ARScheduler
from voice_server.scheduling.base import (
    AdmissionError,
    BaseScheduler,
    CapacityError,
    Emit,
    EmitKind,
    Runner,
    WorkItem,
    WorkKind,
)
from voice_server.scheduling.code2wav import Code2WavScheduler
from voice_server.scheduling.contract import ARSpec, Code2WavSpec, SimpleBatch, SimpleResult
from voice_server.scheduling.simple import SimpleScheduler

if TYPE_CHECKING:
    from voice_server.config import PipelineConfig, StageConfig

AnyScheduler = BaseScheduler[Any, Any]
AnyRunner = Runner[Any, Any]


def _build_simple(stage: StageConfig, runner: AnyRunner) -> AnyScheduler:
    return SimpleScheduler(stage.max_batch_size, stage.batch_window_ms / 1000.0,
                           is_first_output_urgent=runner.is_first_output_urgent)


def _build_ar(stage: StageConfig, runner: AnyRunner) -> AnyScheduler:
    spec = getattr(runner, "ar_spec", None)
    if not isinstance(spec, ARSpec):
        raise TypeError(
            f"stage '{stage.name}': scheduler 'ar' needs a runner with an `ar_spec` (ARSpec) attribute, "
            f"{type(runner).__name__} has {type(spec).__name__}"
        )
    is_cached = stage.prefix_cache and spec.is_prefix_cacheable
    return ARScheduler(spec, stage.max_batch_size, stage.max_step_tokens, is_cached, stage.speech_lead_s)


def _build_code2wav(stage: StageConfig, runner: AnyRunner) -> AnyScheduler:
    spec = getattr(runner, "code2wav_spec", None)
    if not isinstance(spec, Code2WavSpec):
        raise TypeError(
            f"stage '{stage.name}': scheduler 'code2wav' needs a runner with a `code2wav_spec` (Code2WavSpec) "
            f"attribute, {type(runner).__name__} has {type(spec).__name__}"
        )
    return Code2WavScheduler(spec, stage.max_batch_size, stage.initial_chunk_frames, stage.chunk_frames)


SCHEDULER_BUILDERS: dict[str, Callable[[StageConfig, AnyRunner], AnyScheduler]] = {
    "ar": _build_ar,
    "code2wav": _build_code2wav,
    "simple": _build_simple,
}
"""Implemented scheduler types by config name: the single source of truth for `create_scheduler` (which
builds from it, after the runner, since a scheduler may be sized by its runner: KV pages) and
`check_schedulers` (which refuses the rest). A config may name a type that is valid but not yet here
(`config.pipeline.SCHEDULERS`); it becomes usable when its builder is added."""


def check_schedulers(cfg: PipelineConfig) -> None:
    """Every stage's `scheduler` is implemented: a one-line ConfigError naming the first stage whose is not.

    NOTE: here, next to the registry, and not among the config's environment checks
    (`voice_server/config/checks.py`): the schedulers depend on the config package, never the reverse.
    `check-config` (`voice_server/cli_commands.py`, also run before `serve` and `ask` start) calls it beside
    `check_environment`; a stage process refuses the same names when it builds its scheduler
    (`voice_server/engine/runtime.py: create_scheduler`)."""
    for stage in cfg.stages:
        if stage.scheduler not in SCHEDULER_BUILDERS:
            raise fail(
                f"stage '{stage.name}'", "scheduler",
                f"'{stage.scheduler}' is not implemented yet (implemented: {', '.join(sorted(SCHEDULER_BUILDERS))})",
            )

__all__ = [
    "SCHEDULER_BUILDERS",
    "ARScheduler",
    "AdmissionError",
    "AnyRunner",
    "AnyScheduler",
    "BaseScheduler",
    "CapacityError",
    "Code2WavScheduler",
    "Emit",
    "EmitKind",
    "Runner",
    "SimpleBatch",
    "SimpleResult",
    "SimpleScheduler",
    "WorkItem",
    "WorkKind",
    "check_schedulers",
]
