"""The driver's view of a stage process that a `StageHost` runs on its node (`voice_server/engine/stage_host.py`).

`RayProcess` has the members of `multiprocessing.Process` that supervision uses, with a local `sentinel` that becomes
readable when the child exits or its host (actor or node) dies. `RayHosts` (`voice_server/engine/ray_hosts.py`)
spawns them, and watches each host the same way (`_await_actor`).

Deaths are seen through a blocking `StageHost.wait` per child: it returns the exit code ~10 ms after the child
exits, or raises ActorDiedError ~5 ms after the actor dies, or once Ray declares its node dead: at once for a node
that stops cleanly, after the head's health checks for a crashed one (`RAY_health_check_period_ms` x
`RAY_health_check_failure_threshold`, 15 s or more by default). Nothing here uses `ray.util.state`: it needs the
dashboard.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import ray
import ray.exceptions

if TYPE_CHECKING:
    from voice_server.engine.ray_hosts import RayHosts

_POLL_S = 0.25
_DEAD_EXITCODE = -signal.SIGKILL


def _await_actor(call: Callable[[], Any], is_closed: Callable[[], bool]) -> Any:
    """Keep a blocking actor call (`call()` makes its ref) outstanding until it returns something (returned), the
    actor dies or fails it (the RayError returned), or `is_closed()` (None)."""
    try:
        ref = call()
        while not is_closed():
            if not ray.wait([ref], timeout=_POLL_S)[0]:
                continue
            try:
                result = ray.get(ref)
            except ray.exceptions.ActorUnavailableError:
                time.sleep(_POLL_S)  # NOTE: a lost connection, not a verdict: ActorDiedError comes if it is dead
            else:
                if result is not None:
                    return result
            ref = call()
    except Exception as exc:  # NOTE: RayError mostly; whatever it is, the watch ends with it
        return exc
    return None


def _reason(exc: BaseException) -> str:
    lines = [line.strip() for line in str(exc).splitlines() if line.strip() and not line.startswith("\t")]
    return f"{type(exc).__name__}: {' '.join(lines)}"[:400]


@dataclass
class _Host:
    process: str
    bundle: int
    actor: Any
    node_ip: str
    node_id: str
    actor_pid: int
    death_reason: str | None = None


class RayProcess:
    """A stage process in a `StageHost`, as supervision sees a `multiprocessing.Process`. `exitcode` is the child's,
    or -9 with `death_reason` set when its host died under it."""

    def __init__(self, hosts: RayHosts, host: _Host, pid: int) -> None:
        self.pid = pid
        self.death_reason: str | None = None
        self.sentinel, self._sentinel_w = os.pipe()
        self._hosts, self._host = hosts, host
        self._exitcode: int | None = None
        self._done = threading.Event()
        self._is_closed = False
        self._watch = threading.Thread(target=self._watch_child, name=f"watch-{host.process}-{pid}", daemon=True)
        self._watch.start()

    @property
    def exitcode(self) -> int | None:
        return self._exitcode

    def is_alive(self) -> bool:
        return not self._done.is_set()

    def kill(self) -> None:
        self._signal(signal.SIGKILL)

    def terminate(self) -> None:
        self._signal(signal.SIGTERM)

    def join(self, timeout: float | None = None) -> None:
        self._done.wait(timeout)

    def close(self) -> None:
        if self.is_alive():
            raise ValueError("Cannot close a process while it is still running. You should first call join() or "
                             "terminate().")
        if not self._is_closed:
            self._is_closed = True
            os.close(self.sentinel)

    def _signal(self, signum: int) -> None:
        # NOTE: fire and forget, like os.kill: the end shows on the sentinel; a dead host took its child with it.
        if self.is_alive() and self._host.death_reason is None:
            self._host.actor.signal.remote(self.pid, signum)

    def _watch_child(self) -> None:
        outcome = _await_actor(lambda: self._host.actor.wait.remote(self.pid), lambda: self._hosts.is_closed)
        if isinstance(outcome, int):
            self._exitcode = outcome
        elif isinstance(outcome, ray.exceptions.RayActorError):
            self._exitcode, self.death_reason = _DEAD_EXITCODE, self._hosts._mark_dead(self._host, outcome)
        else:
            self._exitcode = _DEAD_EXITCODE
            self.death_reason = (f"lost track of it: {_reason(outcome)}" if outcome is not None
                                 else "its launch's stage hosts were closed")
        self._done.set()
        os.close(self._sentinel_w)  # NOTE: EOF: readable for good, as a process sentinel is
