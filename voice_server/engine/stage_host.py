"""The Ray actor side of the Ray back-end: `StageHost`, the actor that runs one stage process as its child.

`voice_server/engine/ray_hosts.py` (the driver side) schedules one `StageHost` per stage process into that process's
placement-group bundle; the actor's process, a Ray worker on the bundle's node, then does there what the local
launcher does on the server's node (`engine/launcher.py`):
- it spawns the stage process (`bootstrap.start_stage_process`) from one long-lived thread of its own: PDEATHSIG
  (`ipc.die_with_parent`) fires when the *thread* that started the child ends, and Ray's pool threads might not live
  as long as the actor; the spawn sees the environment and a bare `__main__` as a local child's would;
- it reaps each child and answers the driver's blocking `wait` with its exit code, and its blocking `hold` (the
  driver's watch on the host) until it shuts down; blocking calls return at least every `_CALL_SLICE_S`;
- it sweeps the shared-memory segments its process left on this node (segments live on the node, so only its host
  can sweep them): at start (what a predecessor left when it died with its actor), after its last child exits, and
  at shutdown.
The server's death ends the actor (it shares the driver's fate) and, through PDEATHSIG, its children.

NOTE: Ray pickles the actor class by reference, so a worker imports this module to run it: it imports only what the
actor needs (no placement-group code of the driver's).
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing
import multiprocessing.connection
import multiprocessing.process
import os
import queue
import signal
import socket
import sys
import threading
import time
import types
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import Future

import ray

from voice_server.engine.bootstrap import start_stage_process
from voice_server.engine.ipc import owner_process
from voice_server.relay.shm_segments import SEGMENT_PREFIX, list_segments, sweep

log = logging.getLogger("voice_server.ray_hosts")
_SPAWN = multiprocessing.get_context("spawn")
StageTarget = Callable[[dict[str, str], bytes], None]
_CALL_SLICE_S = 30.0
"""A blocking actor call returns at least this often, so one stranded by a lost connection frees its thread."""


class StageHost:
    """Ray actor (threaded, `max_restarts=0`) that runs a process's stage process as its child, on its node."""

    def __init__(self, launch_id: str, process: str, target: StageTarget = start_stage_process) -> None:
        self.launch_id, self.process, self.target = launch_id, process, target
        self._lock = threading.Lock()
        self._live: dict[int, multiprocessing.process.BaseProcess] = {}
        self._exited: dict[int, threading.Event] = {}
        self._exitcodes: dict[int, int] = {}
        self._requests: queue.SimpleQueue[tuple[dict[str, str], bytes, Future[int]]] = queue.SimpleQueue()
        self._closing = threading.Event()
        self._started_env = _started_env()
        self._sweep()  # NOTE: what a predecessor left on this node when it died with its actor
        # NOTE: PDEATHSIG (`ipc.die_with_parent`) fires when the *thread* that started the child ends: children are
        # started by this one, which lives as long as the actor (Ray's pool threads might not).
        threading.Thread(target=self._spawn_forever, name="stage-spawner", daemon=True).start()

    def describe(self) -> tuple[str, str, int]:
        return ray.util.get_node_ip_address(), ray.get_runtime_context().get_node_id(), os.getpid()

    def free_port(self) -> int:
        ip = ray.util.get_node_ip_address()
        with socket.socket(socket.AF_INET6 if ":" in ip else socket.AF_INET) as sock:
            sock.bind((ip, 0))
            return int(sock.getsockname()[1])

    def start(self, env: dict[str, str], spec_bytes: bytes) -> int:
        done: Future[int] = Future()
        self._requests.put((env, spec_bytes, done))
        return done.result()

    def wait(self, pid: int, timeout_s: float = _CALL_SLICE_S) -> int | None:
        """The child's exit code once it has exited and been swept after; None while it runs."""
        with self._lock:
            exited = self._exited.get(pid)
        if exited is None:
            raise ValueError(f"no stage process {pid} in this host")
        return self._exitcodes[pid] if exited.wait(timeout_s) else None

    def signal(self, pid: int, signum: int) -> None:
        with self._lock, contextlib.suppress(ProcessLookupError):
            if pid in self._live:  # NOTE: once reaped, the pid may be someone else's
                os.kill(pid, signum)

    def hold(self, timeout_s: float = _CALL_SLICE_S) -> bool | None:
        """The driver's watch on this host: blocks while it runs; True once it shuts down."""
        return True if self._closing.wait(timeout_s) else None

    def shutdown(self, timeout_s: float) -> None:
        """SIGTERM every child, SIGKILL what is left after `timeout_s`, sweep, release the watch."""
        for signum, wait_s in ((signal.SIGTERM, timeout_s), (signal.SIGKILL, 2.0)):
            with self._lock:
                pids = list(self._live)
            for pid in pids:
                self.signal(pid, signum)
            deadline = time.monotonic() + wait_s
            for pid in pids:
                self._exited[pid].wait(max(0.0, deadline - time.monotonic()))
        self._sweep()
        self._closing.set()

    def _spawn_forever(self) -> None:
        while True:
            env, spec_bytes, done = self._requests.get()
            try:
                child = _SPAWN.Process(target=self.target, args=(env, spec_bytes), name=f"voice-server[{self.process}]",
                                       daemon=True)
                with _as_a_local_parent(self._started_env):
                    child.start()
                assert child.pid is not None
                with self._lock:
                    self._live[child.pid] = child
                    self._exited[child.pid] = threading.Event()
                threading.Thread(target=self._reap, args=(child,), name=f"reap-{child.pid}", daemon=True).start()
                done.set_result(child.pid)
            except Exception as exc:  # NOTE: e.g. EMFILE: the caller's error; this thread must live on
                done.set_exception(exc)

    def _reap(self, child: multiprocessing.process.BaseProcess) -> None:
        multiprocessing.connection.wait([child.sentinel])
        while (code := child.exitcode) is None:  # NOTE: another thread's waitpid may be reaping it
            child.join(0.05)
        pid = child.pid
        assert pid is not None
        with self._lock:
            del self._live[pid]
            self._exitcodes[pid] = code
            is_last = not self._live
        # NOTE: segments live on the node, so only its host can sweep them. Every generation of the process is swept:
        # unless a younger child already runs here (then `shutdown` or the next host sweeps).
        if is_last:
            self._sweep()
        child.close()
        self._exited[pid].set()

    def _sweep(self) -> None:
        prefix = f"{SEGMENT_PREFIX}-{self.launch_id}-"
        owners = {name.removeprefix(prefix).rpartition("-")[0] for name in list_segments(self.launch_id)}
        for owner in sorted(o for o in owners if owner_process(o) == self.process):
            if removed := sweep(self.launch_id, owner):
                log.info("stage host of '%s' swept %d leftover segment(s) of %s", self.process, len(removed), owner)


@contextlib.contextmanager
def _as_a_local_parent(started_env: Mapping[str, str]) -> Iterator[None]:
    """The actor as the server is to a local child, for the span of `Process.start()` (the spawner thread's only):

    - spawn re-runs the parent's `__main__` in the child; in an actor that is Ray's worker script, which imports all
      of Ray (~1 s) before the stage's `env` applies. With a bare one the child runs only `bootstrap.py`;
    - the environment is the one the node started the actor with: Ray sets `OMP_NUM_THREADS=1` (the actor has no
      CPUs: the child's torch would get one thread) and `PYTHONBREAKPOINT` in the worker after it starts.
    """
    main, changed = sys.modules["__main__"], {k: v for k, v in os.environ.items() if started_env.get(k) != v}
    dropped = {k: v for k, v in started_env.items() if k not in os.environ}
    sys.modules["__main__"] = types.ModuleType("__main__")
    for key in changed:
        if key in started_env:
            os.environ[key] = started_env[key]
        else:
            del os.environ[key]
    os.environ.update(dropped)
    try:
        yield
    finally:
        sys.modules["__main__"] = main
        for key in dropped:
            os.environ.pop(key, None)
        os.environ.update(changed)


def _started_env() -> dict[str, str]:
    """This process's environment as it was exec'ed with."""
    with open("/proc/self/environ", "rb") as f:
        entries = [os.fsdecode(entry).partition("=") for entry in f.read().split(b"\0") if entry]
    return {key: value for key, _, value in entries}
