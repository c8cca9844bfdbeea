"""`voice-server serve` as users run it: a real uvicorn process on 127.0.0.1."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def get_health(port: int) -> tuple[int, dict[str, Any]]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def wait_health(port: int, proc: subprocess.Popen[bytes], pred: Any, timeout: float = 90) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.poll() is None, "server exited"
        try:
            code, body = get_health(port)
            if pred(code, body):
                return body
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            pass
        time.sleep(0.05)
    raise AssertionError("health condition not reached")


def is_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie still answers kill(0); read its state.
    with open(f"/proc/{pid}/stat") as f:
        return f.read().split()[2] != "Z"


@pytest.mark.parametrize("stop_signal", [signal.SIGTERM, signal.SIGINT])
def test_serve_health_restart_and_clean_shutdown(stop_signal: int) -> None:
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "voice_server.cli", "serve", "--config", str(ROOT / "configs/test_numeric.yaml"),
         "--host", "127.0.0.1", "--port", str(port), "--log-level", "warning"],
        cwd=ROOT,
    )
    try:
        body = wait_health(port, proc, lambda code, b: code == 200)
        assert body["status"] == "ok"
        assert set(body["stages"]) == {"framer", "transform", "sink"}
        assert all(s["state"] == "ready" for s in body["stages"].values())
        launch_id = body["launch_id"]
        pids = [s["pid"] for s in body["stages"].values()]

        # A dead stage makes the server unhealthy until it has been restarted.
        victim = body["stages"]["sink"]["pid"]
        os.kill(victim, signal.SIGKILL)
        def restarted(code: int, b: dict[str, Any]) -> bool:
            return code == 200 and b["stages"]["sink"]["generation"] == 1

        body = wait_health(port, proc, restarted)
        assert body["stages"]["sink"]["pid"] != victim and body["stages"]["sink"]["num_restarts"] == 1
        pids.append(body["stages"]["sink"]["pid"])

        proc.send_signal(stop_signal)
        assert proc.wait(timeout=30) == 0  # NOTE: `serve` exits 0 after a stop signal
        time.sleep(0.2)
        assert [pid for pid in pids if is_alive(pid)] == []
        assert [n for n in os.listdir("/dev/shm") if n.startswith(f"vs-{launch_id}-")] == []
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_serve_refuses_an_overcommitted_budget(tmp_path: Path) -> None:
    cfg = tmp_path / "greedy.yaml"
    cfg.write_text(
        "name: greedy\nstages:\n"
        "  - {name: a, factory: 'voice_server.stages.numeric:create_echo', memory_fraction: 0.9, next: b}\n"
        "  - {name: b, factory: 'voice_server.stages.numeric:create_echo', memory_fraction: 0.2, terminal: true}\n"
    )
    out = subprocess.run(
        [sys.executable, "-m", "voice_server.cli", "serve", "--config", str(cfg), "--port", str(free_port())],
        capture_output=True, text=True, timeout=60,
    )
    assert out.returncode == 2
    assert "device cpu is over budget: 1.100 > 1.0 (a=0.9, b=0.2)" in out.stderr
