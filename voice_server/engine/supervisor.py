"""Supervision of stage processes: every death is detected, every crash is followed by a restart.

A process that dies, fails its start-up or is not ready within `startup_timeout_s` counts as one
crash. The next attempt waits `restart_backoff_s * 2**(crashes - 1)`, capped at
`max_restart_backoff_s`; a process that stays ready for `_STABLE_S` has its count reset. Nothing is
ever given up for good: once the cause goes away the pipeline recovers by itself.

Deaths are seen two ways: the process sentinel on the event loop (fast) and a periodic tick that
polls every process (always works, even when the loop could not watch a sentinel). An exception
inside a tick is logged and the next tick runs anyway.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from typing import Any

from voice_server.config import PipelineConfig
from voice_server.engine.launcher import Launcher, ProcessHandle, ProcessState

log = logging.getLogger("voice_server.supervisor")
_TICK_S = 0.25
_PROBE_TICK_S = 0.02
"""While a process is starting, probes go out this often (the readiness handshake)."""
_STABLE_S = 60.0


class StartupError(RuntimeError):
    """A stage process failed to load or did not report ready in time."""


class Supervisor:
    def __init__(
        self, cfg: PipelineConfig, launcher: Launcher, on_down: Callable[[ProcessHandle, int, str], None],
        probe: Callable[[], None], on_ready: Callable[[str], None] | None = None,
    ) -> None:
        self.cfg, self.launcher = cfg, launcher
        self._on_down, self._probe, self._on_ready = on_down, probe, on_ready
        self._wake = asyncio.Event()
        self._loop = asyncio.get_running_loop()
        self._watched: dict[str, int] = {}  # process name -> sentinel fd on the loop
        self._is_running = False
        self.is_stopping = False

    # -- messages from the stages ------------------------------------------------------------------

    def on_ready(self, process: str, generation: int, facts: dict[str, dict[str, bool | int | str]]) -> bool:
        """A Ready message; False if it is stale or foreign (wrong generation or state)."""
        handle = self.launcher.handles.get(process)
        if handle is None or handle.generation != generation or handle.state is not ProcessState.STARTING:
            return False
        handle.state, handle.ready_at, handle.facts = ProcessState.READY, time.monotonic(), dict(facts)
        log.info("stage process '%s' ready (generation %d, pid %s)", process, generation, handle.pid)
        if self._on_ready is not None:
            self._on_ready(process)
        return True

    def on_progress(self, process: str, generation: int, stage: str, phase: str) -> None:
        handle = self.launcher.handles.get(process)
        if handle is not None and handle.generation == generation and handle.state is ProcessState.STARTING:
            handle.phases[stage] = phase

    def on_startup_failed(self, process: str, generation: int, message: str) -> bool:
        handle = self.launcher.handles.get(process)
        if handle is None or handle.generation != generation or handle.state is not ProcessState.STARTING:
            return False
        handle.last_error = message
        self._wake.set()
        if not self._is_running:
            handle.state = ProcessState.FAILED  # NOTE: the server's own start-up fails fast
        return True

    # -- start-up ----------------------------------------------------------------------------------

    async def start_all(self) -> None:
        """Spawn every process and wait until all are ready; StartupError names those that are not."""
        for name in self.launcher.handles:
            self._spawn(name)
        deadline = time.monotonic() + self.cfg.startup_timeout_s
        while True:
            failed = []
            for handle in self.launcher.handles.values():
                code = handle.exitcode()
                if handle.state is ProcessState.FAILED or code is not None:
                    handle.state = ProcessState.FAILED
                    handle.last_error = handle.last_error or f"exited with code {code} before it was ready"
                    failed.append(handle)
            if failed:
                raise StartupError("; ".join(f"stage process '{h.name}': {h.last_error}" for h in failed))
            pending = [h.name for h in self.launcher.handles.values() if h.state is not ProcessState.READY]
            if not pending:
                return
            if time.monotonic() > deadline:
                raise StartupError(
                    f"stage process(es) {', '.join(pending)} not ready after {self.cfg.startup_timeout_s:g} s"
                )
            self._probe()
            await asyncio.sleep(_PROBE_TICK_S)

    # -- the supervision loop ------------------------------------------------------------------------

    async def run(self) -> None:
        self._is_running = True
        while not self.is_stopping:
            try:
                self.tick(time.monotonic())
            except Exception:  # NOTE: supervision never stops; the next tick retries
                log.exception("supervision tick failed")
            starting = any(h.state is ProcessState.STARTING for h in self.launcher.handles.values())
            self._wake.clear()
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._wake.wait(), _PROBE_TICK_S if starting else _TICK_S)

    def tick(self, now: float) -> None:
        is_probing = False
        for handle in self.launcher.handles.values():
            handle.reap()
            if handle.state in (ProcessState.STARTING, ProcessState.READY):
                code = handle.exitcode()
                if code is not None:
                    # NOTE: a process on a Ray node says when its host (actor, node) died under it (`RayProcess`).
                    host_death = getattr(handle.process, "death_reason", None)
                    self._down(handle, now, handle.last_error or host_death or f"exited with code {code}")
                elif handle.state is ProcessState.STARTING and handle.last_error:
                    self._down(handle, now, handle.last_error)  # reported StartupFailed
                elif handle.state is ProcessState.STARTING and now > handle.started_at + self.cfg.startup_timeout_s:
                    self._down(handle, now, f"not ready after {self.cfg.startup_timeout_s:g} s")
                elif handle.state is ProcessState.STARTING:
                    is_probing = True
                elif handle.num_crashes and now - handle.ready_at > _STABLE_S:
                    handle.num_crashes = 0
            elif handle.state is ProcessState.RESTARTING and now >= handle.restart_at:
                try:
                    self._spawn(handle.name)
                    handle.num_restarts += 1
                    is_probing = True
                except OSError as exc:  # NOTE: e.g. EMFILE: no pipe for the child; counts as a crash
                    self._schedule_restart(handle, now, f"cannot spawn: {exc}")
        if is_probing:
            self._probe()

    def _down(self, handle: ProcessHandle, now: float, reason: str) -> None:
        generation = handle.generation
        self._unwatch(handle.name)
        self.launcher.kill(handle)  # NOTE: a timed-out or failed start may still be running
        self._schedule_restart(handle, now, reason)
        log.error("stage process '%s' (generation %d) is down: %s; restarting in %.1f s",
                  handle.name, generation, reason, handle.restart_at - now)
        try:
            self._on_down(handle, generation, reason)
        except Exception:
            log.exception("cleanup after stage process '%s' failed", handle.name)

    def _schedule_restart(self, handle: ProcessHandle, now: float, reason: str) -> None:
        handle.num_crashes += 1
        delay = min(self.cfg.max_restart_backoff_s, self.cfg.restart_backoff_s * 2 ** (handle.num_crashes - 1))
        handle.state, handle.restart_at, handle.last_error = ProcessState.RESTARTING, now + delay, reason

    def _spawn(self, name: str) -> None:
        handle = self.launcher.spawn(name)
        handle.last_error = ""
        self._unwatch(name)
        assert handle.process is not None
        try:
            fd = handle.process.sentinel
            self._loop.add_reader(fd, self._wake.set)
            self._watched[name] = fd
        except (OSError, ValueError):  # NOTE: the tick still polls it
            log.warning("cannot watch stage process '%s'; relying on polling", name)

    def _unwatch(self, name: str) -> None:
        fd = self._watched.pop(name, None)
        if fd is not None:
            self._loop.remove_reader(fd)

    def stop(self) -> None:
        self.is_stopping = True
        self._wake.set()
        for name in list(self._watched):
            self._unwatch(name)

    # -- what the coordinator reports -------------------------------------------------------------

    def describe(self, num_inflight: Callable[[str], int] | None = None) -> dict[str, dict[str, Any]]:
        """Stage name -> its process's state and restart history (public: no PIDs). A replicated stage is
        `ready` while one replica is, and lists each under `replicas` with its requests in flight
        (`num_inflight(process)`, the coordinator's count)."""
        stages = {}
        for stage in self.cfg.stages:
            handles = [self.launcher.handles[p] for p in stage.process_names]
            if len(handles) == 1:
                stages[stage.name] = self._describe_handle(stage.name, handles[0])
                continue
            replicas = {}
            for handle in handles:
                replicas[handle.name] = self._describe_handle(stage.name, handle)
                if num_inflight is not None:
                    replicas[handle.name]["num_inflight"] = num_inflight(handle.name)
            ready = [h for h in handles if h.state is ProcessState.READY]
            state = ProcessState.READY if ready else handles[0].state
            # NOTE: the restarts summed, so `/metrics`' per-stage restart count covers every replica.
            stages[stage.name] = {"process": stage.process_name, "state": state.value,
                                  "num_restarts": sum(h.num_restarts for h in handles),
                                  "num_ready_replicas": len(ready), "replicas": replicas}
        return stages

    def _describe_handle(self, stage: str, handle: ProcessHandle) -> dict[str, Any]:
        entry: dict[str, Any] = {
            "process": handle.name, "state": handle.state.value, "generation": handle.generation,
            "num_restarts": handle.num_restarts,
        }
        if handle.state is ProcessState.STARTING and stage in handle.phases:
            entry["phase"] = handle.phases[stage]
        if handle.facts.get(stage):
            entry["runner"] = dict(handle.facts[stage])
        restart_in_s = self.restart_in_s(handle)
        if restart_in_s is not None:
            entry["restart_in_s"] = round(restart_in_s, 2)
            entry["last_error"] = handle.last_error[:200]
        return entry

    def unavailable_reason(self) -> str | None:
        """Why the pipeline cannot take a request now (a stage with no ready process), or None."""
        for stage in self.cfg.stages:
            handles = [self.launcher.handles[p] for p in stage.process_names]
            if any(h.state is ProcessState.READY for h in handles):
                continue  # NOTE: one ready replica serves the stage
            handle = handles[0]
            reason = f"stage process '{handle.name}' is {handle.state.value}"
            if len(handles) > 1:
                reason = f"no replica of stage '{stage.name}' is ready ({reason})"
            restart_in_s = self.restart_in_s(handle)
            if restart_in_s is not None:
                reason += f" (next attempt in {restart_in_s:.1f} s; last error: {handle.last_error})"
            return reason
        return None

    def restart_in_s(self, handle: ProcessHandle) -> float | None:
        if handle.state is not ProcessState.RESTARTING:
            return None
        return max(0.0, handle.restart_at - time.monotonic())
