"""Stage process lifecycle: spawn, terminate, and the bookkeeping of generations and states.

Where a process runs is its back-end's business: `LocalBackend` spawns it on this host (the default), the Ray
back-end (`engine/ray_launch.py`, `launcher: ray`) in an actor on a node of a cluster. Both hand back an object
with the same few members of `multiprocessing.Process` (`StageProcess`), so supervision is the same on both.
"""

from __future__ import annotations

import enum
import logging
import multiprocessing
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from multiprocessing.reduction import ForkingPickler
from typing import Protocol

from voice_server.config import PipelineConfig, StageBudget
from voice_server.engine.bootstrap import start_stage_process
from voice_server.engine.ipc import Endpoints, NodeHosts
from voice_server.engine.limits import EngineLimits
from voice_server.engine.process import ProcessSpec

_SPAWN = multiprocessing.get_context("spawn")


class StageProcess(Protocol):
    """What supervision uses of a stage process, wherever it runs."""

    @property
    def pid(self) -> int | None: ...

    @property
    def sentinel(self) -> int: ...

    @property
    def exitcode(self) -> int | None: ...

    def is_alive(self) -> bool: ...

    def kill(self) -> None: ...

    def terminate(self) -> None: ...

    def join(self, timeout: float | None = None) -> None: ...

    def close(self) -> None: ...


class PlacementPending(OSError):
    """The process cannot be started yet (its node is gone and none can take it): a failed spawn, retried after the
    backoff like any other."""


class StageBackend(Protocol):
    def start(self, timeout_s: float) -> None:
        """Before any spawn: join what the processes run on (raises RuntimeError naming what cannot be placed)."""

    def node_hosts(self) -> NodeHosts | None:
        """Where each process runs, when not all on this host (`Endpoints.create`)."""

    def prepare(self, process: str) -> tuple[str, str] | None:
        """Ready `process` for a spawn: None, or its new (inbox address, node) when it must move to another node.
        Raises PlacementPending while nothing can take it."""

    def spawn(self, process: str, env: dict[str, str], spec_bytes: bytes) -> StageProcess:
        """Start `engine/bootstrap.py: start_stage_process(env, spec_bytes)` for `process`."""

    def close(self) -> None: ...


class LocalBackend:
    """Stage processes spawned on this host (`launcher: local`)."""

    def start(self, timeout_s: float) -> None:
        pass

    def node_hosts(self) -> NodeHosts | None:
        return None

    def prepare(self, process: str) -> tuple[str, str] | None:
        return None

    def spawn(self, process: str, env: dict[str, str], spec_bytes: bytes) -> StageProcess:
        proc = _SPAWN.Process(target=start_stage_process, args=(env, spec_bytes), name=f"voice-server[{process}]",
                              daemon=True)
        proc.start()  # NOTE: may raise (EMFILE, EAGAIN)
        return proc

    def close(self) -> None:
        pass


def create_backend(cfg: PipelineConfig, launch_id: str) -> StageBackend:
    """The back-end `cfg.launcher` names; Ray is imported only when it is the one."""
    if cfg.launcher == "ray":
        from voice_server.engine.ray_launch import RayBackend

        return RayBackend(cfg, launch_id)
    return LocalBackend()


class ProcessState(enum.Enum):
    STARTING = "starting"
    """Spawned; loading or waiting for the readiness handshake."""
    READY = "ready"
    RESTARTING = "restarting"
    """Crashed (or failed to start); waiting out its backoff before the next attempt."""
    FAILED = "failed"
    """Failed during the server's own start-up (the server does not start)."""
    STOPPED = "stopped"


@dataclass
class ProcessHandle:
    name: str
    generation: int = -1
    state: ProcessState = ProcessState.STARTING
    process: StageProcess | None = None
    num_restarts: int = 0
    num_crashes: int = 0
    """Consecutive crashes: sets the backoff; reset once the process has stayed up."""
    started_at: float = 0.0
    ready_at: float = 0.0
    restart_at: float = 0.0
    last_error: str = ""
    phases: dict[str, str] = field(default_factory=dict)
    """Stage -> its last reported startup phase, for the current generation while it starts."""
    facts: dict[str, dict[str, bool | int | str]] = field(default_factory=dict)
    """Stage -> its runner's start-up facts, from the current generation's Ready."""
    retired: list[StageProcess] = field(default_factory=list)
    """Earlier generations not yet reaped."""

    @property
    def pid(self) -> int | None:
        return self.process.pid if self.process is not None else None

    def exitcode(self) -> int | None:
        """The current process's exit code once it has exited (reaps it), else None."""
        if self.process is None or self.process.pid is None:
            return None
        return None if self.process.is_alive() else self.process.exitcode

    def reap(self) -> None:
        """Collect exited earlier generations and release their descriptors."""
        for proc in list(self.retired):
            if not proc.is_alive():
                proc.close()
                self.retired.remove(proc)


class Launcher:
    def __init__(
        self, cfg: PipelineConfig, launch_id: str, budgets: list[StageBudget], endpoints: Endpoints,
        limits: EngineLimits, backend: StageBackend | None = None,
        on_moved: Callable[[str, str, str], None] | None = None,
    ) -> None:
        self.cfg = cfg
        self.backend: StageBackend = backend or LocalBackend()
        self.on_moved = on_moved
        """Told (process, address, node) when a process is about to start on another node than before."""
        self.endpoints = endpoints
        self.launch_id = launch_id
        self.limits = limits
        self.budgets = {b.stage: b.num_bytes for b in budgets}
        self.handles = {name: ProcessHandle(name) for name in cfg.processes}

    def spawn(self, name: str) -> ProcessHandle:
        handle = self.handles[name]
        moved = self.backend.prepare(name)  # NOTE: may raise PlacementPending: the handle is unchanged then
        if moved is not None:
            self.endpoints.move(name, *moved)  # NOTE: before the spec is made: it carries the new address
            if self.on_moved is not None:
                self.on_moved(name, *moved)
        spec = ProcessSpec(
            self.launch_id, name, handle.generation + 1, self.cfg, self.budgets, self.endpoints, self.limits,
            logging.getLogger().getEffectiveLevel(),
        )
        # NOTE: the spec goes pickled so the child applies the stages' `env` before unpickling it
        # imports the engine and torch (`engine/bootstrap.py`).
        args = (self.cfg.process_env(name), bytes(ForkingPickler.dumps(spec)))
        process = self.backend.spawn(name, *args)  # NOTE: may raise (EMFILE, EAGAIN): the handle is unchanged then
        if handle.process is not None:
            handle.retired.append(handle.process)
        handle.generation += 1
        handle.phases.clear()
        handle.facts.clear()
        handle.process = process
        handle.state = ProcessState.STARTING
        handle.started_at = time.monotonic()
        return handle

    def kill(self, handle: ProcessHandle) -> None:
        proc = handle.process
        if proc is not None and proc.pid is not None and proc.is_alive():
            proc.kill()

    def terminate_all(self, timeout_s: float = 5.0) -> None:
        """SIGTERM every live process, wait, then SIGKILL stragglers: no orphans survive."""
        procs = [p for h in self.handles.values() for p in [h.process, *h.retired] if p is not None]
        live = [p for p in procs if p.pid is not None and p.is_alive()]
        for proc in live:
            proc.terminate()
        deadline = time.monotonic() + timeout_s
        for proc in live:
            proc.join(max(0.0, deadline - time.monotonic()))
            if proc.is_alive():
                proc.kill()
                proc.join(1.0)
        for handle in self.handles.values():
            handle.state = ProcessState.STOPPED
