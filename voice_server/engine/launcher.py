"""Stage process lifecycle: spawn, terminate, and the bookkeeping of generations and states."""

from __future__ import annotations

import enum
import multiprocessing
import multiprocessing.process
import os
import signal
import time
from dataclasses import dataclass, field

from voice_server.config import PipelineConfig, StageBudget
from voice_server.engine.ipc import Endpoints
from voice_server.engine.stage import ProcessSpec, run_stage_process

_SPAWN = multiprocessing.get_context("spawn")


class ProcessState(enum.Enum):
    STARTING = "starting"
    READY = "ready"
    RESTARTING = "restarting"
    FAILED = "failed"
    STOPPED = "stopped"


@dataclass
class ProcessHandle:
    name: str
    generation: int = -1
    state: ProcessState = ProcessState.STARTING
    process: multiprocessing.process.BaseProcess | None = None
    num_restarts: int = 0
    crash_times: list[float] = field(default_factory=list)
    last_error: str = ""

    @property
    def pid(self) -> int | None:
        return self.process.pid if self.process is not None else None


class Launcher:
    def __init__(self, cfg: PipelineConfig, launch_id: str, budgets: list[StageBudget], endpoints: Endpoints) -> None:
        self.cfg = cfg
        self.endpoints = endpoints
        self.launch_id = launch_id
        self.budgets = {b.stage: b.num_bytes for b in budgets}
        self.handles = {name: ProcessHandle(name) for name in cfg.processes}

    def spawn(self, name: str) -> ProcessHandle:
        handle = self.handles[name]
        handle.generation += 1
        spec = ProcessSpec(self.launch_id, name, handle.generation, self.cfg, self.budgets, self.endpoints)
        handle.process = _SPAWN.Process(target=run_stage_process, args=(spec,), name=f"vs-{name}", daemon=True)
        handle.process.start()
        return handle

    def terminate_all(self, timeout_s: float = 5.0) -> None:
        """SIGTERM every live process, wait, then SIGKILL stragglers: no orphans survive."""
        live = [h.process for h in self.handles.values() if h.process is not None and h.process.is_alive()]
        for proc in live:
            if proc.pid is not None:
                os.kill(proc.pid, signal.SIGTERM)
        deadline = time.monotonic() + timeout_s
        for proc in live:
            proc.join(max(0.0, deadline - time.monotonic()))
            if proc.is_alive():
                proc.kill()
                proc.join(1.0)
        for handle in self.handles.values():
            handle.state = ProcessState.STOPPED
