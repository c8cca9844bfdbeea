"""Test harness: a coordinator with real stage processes, driven from a loop thread.

The coordinator lives on an asyncio loop in a background thread so a module can share one
pipeline across tests while each test calls into it synchronously with `run(coro)`.
"""

from __future__ import annotations

import asyncio
import os
import threading
from collections.abc import Coroutine
from pathlib import Path
from typing import Any, TypeVar

from voice_server.config import PipelineConfig
from voice_server.engine.coordinator import Coordinator

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

    def close(self) -> None:
        self.lt.run(self.coordinator.stop())
        self.lt.close()


def shm_segments(launch_id: str) -> list[str]:
    return [n for n in os.listdir("/dev/shm") if n.startswith(f"vs-{launch_id}-")]




def stage_processes(parent_pid: int) -> dict[str, int]:
    """Live stage processes of a server, by the name they show in `ps` (`voice-server[name]`)."""
    found = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                cmdline = f.read().split(b"\0")[0].decode(errors="replace")
        except OSError:
            continue
        state, ppid = fields[0], int(fields[1])
        if ppid == parent_pid and state != "Z" and cmdline.startswith("voice-server[") and cmdline.endswith("]"):
            found[cmdline[len("voice-server["):-1]] = int(entry)
    return found


def all_shm_segments() -> set[str]:
    return {n for n in os.listdir("/dev/shm") if n.startswith("vs-")}


def launch_of(stage_pid: int) -> str:
    """The launch id of a running stage process, read from its shared-memory mappings."""
    with open(f"/proc/{stage_pid}/maps") as f:
        for line in f:
            path = line.split()[-1]
            if path.startswith("/dev/shm/vs-"):
                return path[len("/dev/shm/vs-"):].split("-", 1)[0]
    raise LookupError(f"process {stage_pid} maps no relay segment")
