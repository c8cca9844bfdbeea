"""Helpers for tests that run `voice-server serve` as a real process on 127.0.0.1 (imported by
the tests in this directory, which put it on sys.path)."""

from __future__ import annotations

import os
import resource
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path

from harness import children_of, wait_gone

ROOT = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent
NUMERIC_CONFIG = ROOT / "configs/test_numeric.yaml"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def health_status(port: int, timeout: float = 2.0) -> int | None:
    """The status of GET /health on a fresh connection; None if it got no answer."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=timeout) as resp:
            return int(resp.status)
    except urllib.error.HTTPError as exc:
        return int(exc.code)
    except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
        return None


class ServerProcess:
    def __init__(self, proc: subprocess.Popen[bytes], port: int, stderr_path: Path) -> None:
        self.proc = proc
        self.port = port
        self.stderr_path = stderr_path

    @property
    def stderr(self) -> str:
        return self.stderr_path.read_text(errors="replace")

    @property
    def num_stderr_bytes(self) -> int:
        return self.stderr_path.stat().st_size

    def wait_healthy(self, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, f"server exited with {self.proc.returncode}:\n{self.stderr}"
            if health_status(self.port) == 200:
                return
            time.sleep(0.05)
        raise AssertionError(f"server not healthy after {timeout} s:\n{self.stderr}")

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 10.0) -> int:
        self.proc.send_signal(sig)
        return self.proc.wait(timeout)


def _limit_descriptors(num_fds: int) -> Callable[[], None]:
    def apply() -> None:
        resource.setrlimit(resource.RLIMIT_NOFILE, (num_fds, num_fds))

    return apply


class Launcher:
    """Starts `serve` processes (stderr to a file, so tests can measure the log), optionally under a
    descriptor limit set with `resource.setrlimit` in the child; `close` kills what is left."""

    def __init__(self, tmp_path: Path) -> None:
        self.tmp_path = tmp_path
        self.started: list[ServerProcess] = []

    def start(
        self, *args: str, config: Path = NUMERIC_CONFIG, num_fds: int | None = None, log_level: str = "warning"
    ) -> ServerProcess:
        port = free_port()
        stderr_path = self.tmp_path / f"stderr-{len(self.started)}.log"
        env = dict(os.environ)
        # NOTE: the worktree's package first, then this directory for `slow_factory` (stage processes
        # inherit the environment and the parent's sys.path).
        env["PYTHONPATH"] = os.pathsep.join([str(ROOT), str(HERE), env.get("PYTHONPATH", "")])
        with open(stderr_path, "wb") as stderr:
            proc = subprocess.Popen(
                [sys.executable, "-m", "voice_server.cli", "serve", "--config", str(config), "--host", "127.0.0.1",
                 "--port", str(port), "--log-level", log_level, *args],
                cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=stderr,
                preexec_fn=_limit_descriptors(num_fds) if num_fds else None,
            )
        server = ServerProcess(proc, port, stderr_path)
        self.started.append(server)
        return server

    def close(self) -> None:
        for server in self.started:
            if server.proc.poll() is not None:
                continue
            children = children_of(server.proc.pid)
            server.proc.terminate()  # NOTE: a clean stop removes the launch's shared memory; a kill cannot
            try:
                server.proc.wait(10)
            except subprocess.TimeoutExpired:
                server.proc.kill()
                server.proc.wait()
            for pid in wait_gone(children, 5.0):
                os.kill(pid, signal.SIGKILL)
