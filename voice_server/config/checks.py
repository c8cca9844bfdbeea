"""Environment checks: what can be known about a valid config on this host without starting anything.

`check_environment` runs them all (`check-config` and, before it starts anything, `serve`). One function
per rule, each raising a one-line `ConfigError` that names the stage or pipeline and the field:

- every stage's `factory` resolves: its module imports and has the callable (not called);
- the relay slabs fit in `/dev/shm`;
- with `control_transport: tcp`, `tcp_host` is an address this host can bind;
- every `cuda:N` a stage names is a CUDA device this host has (skippable: a GPU config can be checked
  on a laptop or in CI, everything but the devices);
- with `turn_detection: semantic_vad`, the end-of-turn model files are installed.

NOTE: that every stage's `scheduler` is implemented is checked next to the scheduler registry
(`voice_server/scheduling/__init__.py: check_schedulers`): the config package does not depend on the
schedulers, which depend on it.
"""

from __future__ import annotations

import importlib
import os
import socket
from collections.abc import Callable
from typing import Any

from voice_server.config.errors import fail, one_line
from voice_server.config.pipeline import PipelineConfig, StageConfig

SHM_DIR = "/dev/shm"
"""Where relay slabs live (the same directory as `voice_server.relay.shm_segments.SHM_DIR`, which pulls in numpy
and the relay package, so it is not imported here)."""


def resolve_factory(stage: StageConfig) -> Callable[..., Any]:
    """Import the stage's factory module and return the factory, without calling it."""
    module_name, _, attr = stage.factory.partition(":")
    where = f"stage '{stage.name}'"
    try:
        module = importlib.import_module(module_name)
    # NOTE: anything a module raises at import time (SyntaxError, a missing native library, even
    # sys.exit) is this stage's factory failing, and must read as such, on one line.
    except (Exception, SystemExit) as exc:
        raise fail(where, "factory", f"cannot import module '{module_name}': {_cause(exc)}") from exc
    try:
        factory = getattr(module, attr)
    except AttributeError as exc:
        raise fail(where, "factory", f"module '{module_name}' has no attribute '{attr}'") from exc
    if not callable(factory):
        raise fail(where, "factory", f"{stage.factory} is a {type(factory).__name__}, not a callable")
    return factory


def check_factories(cfg: PipelineConfig) -> None:
    for stage in cfg.stages:
        resolve_factory(stage)


def check_shm(cfg: PipelineConfig, shm_dir: str = SHM_DIR) -> None:
    """Worst case: every stage process and the coordinator each hold one full slab at once."""
    # NOTE: overflow segments (tensors larger than the free slab space) come on top; they are
    # transient and sized by traffic, so only the slabs are a start-up certainty.
    num_processes = len(cfg.processes)
    num_slabs = num_processes + 1
    need = num_slabs * cfg.relay_slab_bytes
    where = f"pipeline '{cfg.name}'"
    try:
        st = os.statvfs(shm_dir)
    except OSError as exc:
        raise fail(where, "relay_slab_bytes", f"cannot check free space of {shm_dir}: {_cause(exc)}") from exc
    free = st.f_bavail * st.f_frsize
    if need > free:
        raise fail(
            where, "relay_slab_bytes",
            f"{num_slabs} slabs ({num_processes} stage process{'' if num_processes == 1 else 'es'} + the "
            f"coordinator) of {_size(cfg.relay_slab_bytes)} need {_size(need)}, but {shm_dir} has {_size(free)} free",
        )


def check_tcp_host(cfg: PipelineConfig) -> None:
    if cfg.control_transport != "tcp":
        return
    # NOTE: the same bind the launcher does first (`engine/ipc.py: _free_ports`), to an ephemeral port.
    sock = socket.socket()
    try:
        sock.bind((cfg.tcp_host, 0))
    except (OSError, OverflowError, UnicodeError) as exc:
        raise fail(
            f"pipeline '{cfg.name}'", "tcp_host",
            f"cannot bind {cfg.tcp_host!r} on this host: {_cause(exc)}",
        ) from exc
    finally:
        sock.close()


def cuda_device_count() -> int:
    """CUDA devices this host shows: 0 without a driver, a GPU, or a CUDA build of torch."""
    import torch

    # NOTE: device_count asks NVML where it can, and creates no CUDA context in this process.
    return int(torch.cuda.device_count())


def check_devices(cfg: PipelineConfig, count_devices: Callable[[], int] = cuda_device_count) -> None:
    gpu_stages = [s for s in cfg.stages if s.device_key != "cpu"]
    if not gpu_stages or cfg.launcher == "ray":
        return  # NOTE: placed on a cluster, the devices are the nodes' (a stage process fails on a missing one)
    count = count_devices()
    for stage in gpu_stages:
        index = int(stage.device_key.partition(":")[2])
        if index >= count:
            have = "no CUDA device" if count == 0 else f"{count} CUDA device{'' if count == 1 else 's'}"
            raise fail(
                f"stage '{stage.name}'", "device",
                f"{stage.device} is not on this host ({have} visible); run it on the GPU host, or "
                "`check-config --skip-device-check` to check everything else",
            )


def check_turn_models(cfg: PipelineConfig) -> None:
    """`semantic_vad` sessions need Smart Turn and Silero VAD, which ship in the pipecat-ai wheel."""
    if cfg.turn_detection != "semantic_vad":
        return
    from voice_server.session.turn_models import SILERO_FILE, SMART_TURN_FILE, pipecat_data_file

    for relative in (SMART_TURN_FILE, SILERO_FILE):
        try:
            pipecat_data_file(relative)
        except RuntimeError as exc:
            raise fail(f"pipeline {cfg.name!r}", "turn_detection", f"semantic_vad: {exc}") from exc


def check_environment(cfg: PipelineConfig, *, is_import_allowed: bool = True, is_device_check: bool = True) -> None:
    """Run every environment check, cheapest first; raises the first ConfigError.

    `is_import_allowed=False` skips resolving factories and counting GPUs: both import torch (and
    model code) into a process (the server's) that should not hold it. The stage processes resolve
    their factories anyway, and fail on a missing device when they place their weights.
    `is_device_check=False` skips only the GPU count (`check-config --skip-device-check`).
    """
    check_tcp_host(cfg)
    check_shm(cfg)
    check_turn_models(cfg)
    if is_import_allowed:
        if is_device_check:
            check_devices(cfg)
        check_factories(cfg)


def _cause(exc: BaseException) -> str:
    text = str(exc)
    return one_line(f"{type(exc).__name__}: {text}" if text else type(exc).__name__)


def _size(num_bytes: int) -> str:
    for unit, shift in (("TiB", 40), ("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if num_bytes >= 1 << shift:
            return f"{num_bytes / (1 << shift):.1f} {unit}"
    return f"{num_bytes} B"

