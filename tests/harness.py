"""Test harness: a coordinator with real stage processes, driven from a loop thread.

The coordinator lives on an asyncio loop in a background thread so a module can share one
pipeline across tests while each test calls into it synchronously with `run(coro)`.
"""

from __future__ import annotations

import asyncio
import os
import threading
import time
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any, TypeVar

import pytest

from voice_server.config import PipelineConfig
from voice_server.engine.coordinator import Coordinator, RequestError, StartupError

T = TypeVar("T")
CONFIGS = Path(__file__).resolve().parents[1] / "configs"


class LoopThread:
    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    def run(self, coro: Coroutine[Any, Any, T], timeout: float = 60.0) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)


class Pipeline:
    """A started coordinator plus the loop it runs on."""

    def __init__(self, cfg: PipelineConfig) -> None:
        self.lt = LoopThread()
        self.coordinator = Coordinator(cfg)
        self.lt.run(self.coordinator.start())

    def run(self, coro: Coroutine[Any, Any, T], timeout: float = 60.0) -> T:
        return self.lt.run(coro, timeout)

    def collect(self, payload: dict[str, Any], params: dict[str, Any] | None = None) -> list[Any]:
        async def go() -> list[Any]:
            return [o async for o in self.coordinator.submit(payload, params)]

        return self.run(go())

    def collect_all(
        self, payloads: list[dict[str, Any]], params: dict[str, Any] | list[dict[str, Any]] | None = None,
        stagger_s: float = 0.0, timeout: float = 60.0,
    ) -> list[Any]:
        """Every payload submitted at once (or the i-th after `i * stagger_s`), with `params` or its own of a list:
        each one's outputs, or the RequestError that ended it."""
        async def one(i: int, payload: dict[str, Any]) -> Any:
            await asyncio.sleep(i * stagger_s)
            try:
                return [o async for o in self.coordinator.submit(payload, params[i] if isinstance(params, list)
                                                                 else params)]
            except RequestError as exc:
                return exc

        async def go() -> list[Any]:
            return await asyncio.gather(*(one(i, p) for i, p in enumerate(payloads)))

        return self.run(go(), timeout)

    def close(self) -> None:
        self.lt.run(self.coordinator.stop())
        self.lt.close()


def shm_segments(launch_id: str) -> list[str]:
    return [n for n in os.listdir("/dev/shm") if n.startswith(f"vs-{launch_id}-")]


def wait_for(pred: Callable[[], T], timeout: float = 10.0, interval: float = 0.02) -> T:
    """Poll `pred` every `interval` s until it returns something truthy or `timeout` s have passed;
    returns its last value (falsy on timeout), so the caller asserts the precise condition itself.

    Use it instead of sleeping a guessed time before an assertion on something that happens
    asynchronously: `timeout` can then be generous without slowing the test down."""
    deadline = time.monotonic() + timeout
    while not (value := pred()) and time.monotonic() < deadline:
        time.sleep(interval)
    return value


def _stat(pid: int | str) -> tuple[str, int] | None:
    """(state, parent pid) of a process from /proc, None if it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return fields[0], int(fields[1])


def is_alive(pid: int) -> bool:
    stat = _stat(pid)
    return stat is not None and stat[0] != "Z"  # NOTE: a zombie still answers kill(pid, 0)


def children_of(pid: int) -> list[int]:
    """Live processes whose parent is `pid`."""
    return [int(e) for e in os.listdir("/proc") if e.isdigit() and (st := _stat(e)) and st[1] == pid and st[0] != "Z"]


def wait_gone(pids: list[int], timeout: float = 5.0) -> list[int]:
    """Wait until the processes have exited; returns those still alive after `timeout`."""
    deadline = time.monotonic() + timeout
    alive = [p for p in pids if is_alive(p)]
    while alive and time.monotonic() < deadline:
        time.sleep(0.05)
        alive = [p for p in alive if is_alive(p)]
    return alive


def stage_processes(parent_pid: int) -> dict[str, int]:
    """Live stage processes of a server, by the name they show in `ps` (`voice-server[name]`)."""
    found = {}
    for pid in children_of(parent_pid):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                title = f.read().split(b"\0")[0].decode(errors="replace")
        except OSError:
            continue
        if title.startswith("voice-server[") and title.endswith("]"):
            found[title[len("voice-server["):-1]] = pid
    return found


def assert_start_fails(cfg: PipelineConfig, match: str) -> None:
    """Starting `cfg` raises StartupError matching `match` and leaves no process or segment behind."""
    lt = LoopThread()
    coordinator = Coordinator(cfg)
    try:
        with pytest.raises(StartupError, match=match):
            lt.run(coordinator.start())
    finally:
        lt.close()
    for handle in coordinator.launcher.handles.values():
        assert handle.process is not None and not handle.process.is_alive()
    assert shm_segments(coordinator.launch_id) == []


def launch_of(stage_pid: int) -> str:
    """The launch id of a running stage process, read from its shared-memory mappings."""
    with open(f"/proc/{stage_pid}/maps") as f:
        for line in f:
            path = line.split()[-1]
            if path.startswith("/dev/shm/vs-"):
                return path[len("/dev/shm/vs-"):].split("-", 1)[0]
    raise LookupError(f"process {stage_pid} maps no relay segment")
