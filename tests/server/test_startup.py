"""`serve` start-up against real processes: the port opens before the stages load (`/health` 503 with
each stage's progress, sessions closed with 1013), a stop signal while a stage loads ends it within
about a second with nothing left behind, and a failed start-up is one paragraph on stderr with exit 2."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from websockets.exceptions import ConnectionClosed
from websockets.sync.client import connect

sys.path.insert(0, str(Path(__file__).parent))
from harness import children_of, wait_gone
from serving import ServerProcess, health_status  # noqa: E402

ServeProcess = Callable[..., ServerProcess]
_RECORD_START = re.compile(r"^(\d{4}-\d\d-\d\d |start-up error: |config error: )")


def write_config(tmp_path: Path, factory: str, *, startup_timeout_s: float = 60.0, load_s: float = 20.0) -> Path:
    path = tmp_path / "pipeline.yaml"
    path.write_text(
        f"name: startup-test\nstartup_timeout_s: {startup_timeout_s}\nstages:\n"
        f"  - {{name: slow, factory: '{factory}', terminal: true, memory_fraction: 0.01, "
        f"factory_args: {{load_s: {load_s}}}}}\n"
    )
    return path


def launch_segments(process: str) -> dict[str, list[str]]:
    """Launch id -> its /dev/shm segments, for launches with a stage process named `process`."""
    names = os.listdir("/dev/shm")
    launches = {n.split("-")[1] for n in names if n.startswith("vs-") and f"-{process}." in n}
    return {launch: [n for n in names if n.startswith(f"vs-{launch}-")] for launch in launches}


def server_records(stderr: str, child: str) -> str:
    """stderr without the log records of stage process `child` (they carry `[child]`)."""
    records: list[list[str]] = []
    for line in stderr.splitlines():
        if _RECORD_START.match(line) or not records:
            records.append([line])
        else:
            records[-1].append(line)
    return "\n".join("\n".join(r) for r in records if f"[{child}]" not in r[0])


def get(port: int, path: str) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as resp:
            return int(resp.status), resp.read()
    except urllib.error.HTTPError as exc:
        return int(exc.code), exc.read()


def session_refusal(port: int) -> tuple[int, str] | None:
    """The close code and reason of a `/ws` session refused at once; None if it was admitted."""
    ws = connect(f"ws://127.0.0.1:{port}/ws", open_timeout=5)
    try:
        ws.send(json.dumps({"type": "session.start"}))  # NOTE: a refusal may already have closed it
        ws.recv(5)
    except ConnectionClosed as exc:
        assert exc.rcvd is not None
        return exc.rcvd.code, exc.rcvd.reason
    ws.close()
    return None


def test_the_port_opens_first_and_health_shows_progress_while_a_stage_loads(
    serve_process: ServeProcess, tmp_path: Path
) -> None:
    launched = time.monotonic()
    server = serve_process(config=write_config(tmp_path, "slow_factory:create", load_s=6))
    while health_status(server.port) is None:
        assert server.proc.poll() is None and time.monotonic() < launched + 30, server.stderr
        time.sleep(0.05)
    listening = time.monotonic()
    code, body = get(server.port, "/health")
    health: dict[str, Any] = json.loads(body)
    assert code == 503 and health["status"] == "starting", health
    assert health["stages"]["slow"]["state"] == "starting"
    deadline = time.monotonic() + 10
    while "phase" not in health["stages"]["slow"]:  # NOTE: the stage process reports once it runs
        assert time.monotonic() < deadline, health
        time.sleep(0.05)
        health = json.loads(get(server.port, "/health")[1])
    assert health["stages"]["slow"]["phase"] == "loading weights", health
    assert session_refusal(server.port) == (1013, "the pipeline is not ready (starting or restarting); try again later")
    code, body = get(server.port, "/metrics")
    assert code == 200 and b'voice_server_sessions_refused_total{endpoint="native",reason="not_ready"} 1.0' in body
    server.wait_healthy(timeout=60)
    ready = time.monotonic()
    print(f"listening {listening - launched:.1f} s after launch, ready {ready - launched:.1f} s after launch")
    assert ready - listening > 3.0  # the port answered for most of the 6 s load
    code, body = get(server.port, "/health")
    health = json.loads(body)
    assert code == 200 and health["status"] == "ok" and health["stages"]["slow"]["state"] == "ready"
    assert "phase" not in health["stages"]["slow"]  # NOTE: only while it starts
    assert session_refusal(server.port) is None
    ws = connect(f"ws://127.0.0.1:{server.port}/ws", open_timeout=5)
    ws.send(json.dumps({"type": "session.start"}))
    assert json.loads(ws.recv(5))["type"] == "session.started"
    assert server.stop() == 0
    with pytest.raises(ConnectionClosed) as info:  # a stop closes the open session with 1001
        ws.recv(5)
    assert info.value.rcvd is not None and (info.value.rcvd.code, info.value.rcvd.reason) == (
        1001, "server shutting down")


@pytest.mark.parametrize("stop_signal", [signal.SIGTERM, signal.SIGINT])
def test_a_stop_signal_while_a_stage_loads_ends_serve_at_once(
    serve_process: ServeProcess, tmp_path: Path, stop_signal: int
) -> None:
    before = set(launch_segments("slow"))
    server = serve_process(config=write_config(tmp_path, "slow_factory:create", load_s=20), log_level="info")
    deadline = time.monotonic() + 30
    launches: set[str] = set()
    children: list[int] = []
    while time.monotonic() < deadline and not (launches and children):
        assert server.proc.poll() is None, server.stderr
        launches = set(launch_segments("slow")) - before  # the stage's segment exists once its shell runs
        children = children_of(server.proc.pid)
        time.sleep(0.05)
    assert len(launches) == 1, f"no stage started: {server.stderr}"
    time.sleep(0.5)  # well inside the 20 s load
    children = children_of(server.proc.pid)
    started = time.monotonic()
    rc = server.stop(stop_signal, timeout=15)
    took = time.monotonic() - started
    left = wait_gone(children, 2.0)
    print(f"{signal.Signals(stop_signal).name} while loading: serve exited {rc} in {took:.2f} s; children {children}")
    assert rc == 0, server.stderr
    assert took < 5.0
    assert left == []
    assert launch_segments("slow").get(launches.pop(), []) == []
    assert "Traceback" not in server.stderr


def test_a_stop_signal_while_serving_with_connections_open_ends_serve_at_once(serve_process: ServeProcess) -> None:
    server = serve_process("--request-head-timeout", "30", "--keep-alive-timeout", "30")
    server.wait_healthy()
    children = children_of(server.proc.pid)
    conns = [socket.create_connection(("127.0.0.1", server.port), timeout=5) for _ in range(50)]
    for i, conn in enumerate(conns):
        conn.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n" if i % 2 else b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
    time.sleep(0.5)  # half are idle keep-alive connections, half are stuck in their request head
    started = time.monotonic()
    rc = server.stop(signal.SIGTERM, timeout=15)
    took = time.monotonic() - started
    for conn in conns:
        conn.close()
    print(f"SIGTERM while serving 50 open connections: serve exited {rc} in {took:.2f} s")
    assert rc == 0 and took < 5.0
    assert wait_gone(children, 2.0) == []


def test_a_stage_that_fails_to_load_is_one_paragraph(serve_process: ServeProcess, tmp_path: Path) -> None:
    # NOTE: a factory that resolves but raises in its stage process: one that does not resolve is refused
    # before anything starts, as `check-config` refuses it (test_serve_checks_and_signals.py).
    config = write_config(tmp_path, "slow_factory:create")
    config.write_text(config.read_text().replace("load_s: 20.0", "load_s: oops"))
    server = serve_process(config=config)
    rc = server.proc.wait(60)
    own = server_records(server.stderr, "slow")
    print(f"exit {rc}; the server's own stderr:\n{own}")
    assert rc == 2
    assert "Traceback" not in own
    errors = [line for line in own.splitlines() if line.startswith("start-up error: ")]
    assert len(errors) == 1, own
    assert "stage process 'slow'" in errors[0] and "stage 'slow' has factory slow_factory:create" in errors[0]
    assert "ValueError: could not convert string to float: 'oops'" in errors[0]
    assert "Traceback" not in server.stderr  # the stage process logs one line too


def test_a_stage_that_loads_too_long_is_one_paragraph(serve_process: ServeProcess, tmp_path: Path) -> None:
    before = set(launch_segments("slow"))
    config = write_config(tmp_path, "slow_factory:create", startup_timeout_s=1, load_s=20)
    server = serve_process(config=config)
    started = time.monotonic()
    rc = server.proc.wait(30)
    print(f"start-up timeout: exit {rc} after {time.monotonic() - started:.1f} s; stderr:\n{server.stderr}")
    assert rc == 2
    assert "Traceback" not in server.stderr
    errors = [line for line in server.stderr.splitlines() if line.startswith("start-up error: ")]
    assert len(errors) == 1 and "slow not ready after 1 s" in errors[0] and "startup_timeout_s" in errors[0]
    assert all(not segments for launch, segments in launch_segments("slow").items() if launch not in before)


def test_a_port_in_use_fails_before_the_stages_load(serve_process: ServeProcess, tmp_path: Path) -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        server = serve_process(
            "--port", str(port), config=write_config(tmp_path, "slow_factory:create", load_s=20)
        )  # NOTE: the later --port wins
        started = time.monotonic()
        rc = server.proc.wait(30)
    took = time.monotonic() - started
    print(f"port in use: exit {rc} after {took:.1f} s; stderr:\n{server.stderr}")
    assert rc == 2 and took < 15  # not after the 20 s load
    expected = f"start-up error: cannot bind 127.0.0.1:{port}: Address already in use"
    assert server.stderr.strip().splitlines() == [expected]


def test_bad_limits_are_refused_by_the_command_line(serve_process: ServeProcess) -> None:
    server = serve_process("--max-connections", "0")
    assert server.proc.wait(30) == 2
    assert "--max-connections: must be an integer >= 1" in server.stderr
