"""`voice-server serve` as users run it: a real uvicorn process on 127.0.0.1."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest
from harness import is_alive, launch_of, shm_segments, stage_processes, wait_gone
from prometheus_client.parser import text_string_to_metric_families
from serving import free_port

from voice_server.engine.rundir import base_dir

ROOT = Path(__file__).resolve().parents[2]


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


def scrape(port: int) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2) as resp:
        text = resp.read().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


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
        # NOTE: /health publishes no PIDs or launch id; operators find stages by name in `ps`.
        assert "launch_id" not in body and all("pid" not in s for s in body["stages"].values())
        stages = stage_processes(proc.pid)
        assert set(stages) == {"framer", "transform", "sink"}
        pids = list(stages.values())
        launch_id = launch_of(stages["framer"])

        # A dead stage makes the server unhealthy until it has been restarted.
        victim = stages["sink"]
        os.kill(victim, signal.SIGKILL)
        def restarted(code: int, b: dict[str, Any]) -> bool:
            return code == 200 and b["stages"]["sink"]["generation"] == 1

        body = wait_health(port, proc, restarted)
        assert body["stages"]["sink"]["num_restarts"] == 1
        # The same, as series to alert on (read from the coordinator at each scrape).
        series = scrape(port)
        assert series[("voice_server_stage_restarts_total", (("stage", "sink"),))] == 1
        assert series[("voice_server_stage_restarts_total", (("stage", "framer"),))] == 0
        assert series[("voice_server_pipeline_ready", ())] == 1
        assert series[("voice_server_inflight_requests", ())] == 0
        new_sink = stage_processes(proc.pid)["sink"]
        assert new_sink != victim
        pids.append(new_sink)

        proc.send_signal(stop_signal)
        assert proc.wait(timeout=30) == 0  # NOTE: `serve` exits 0 after a stop signal
        assert wait_gone(pids, timeout=10) == []  # no stage process outlives the server
        assert shm_segments(launch_id) == []
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


def start_server() -> tuple[subprocess.Popen[bytes], int]:
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "voice_server.cli", "serve", "--config", str(ROOT / "configs/test_numeric.yaml"),
         "--host", "127.0.0.1", "--port", str(port), "--log-level", "warning"],
        cwd=ROOT,
    )
    return proc, port


def test_a_sigkilled_server_leaves_nothing_once_the_next_has_started_and_stopped() -> None:
    run_base = base_dir()
    first, port = start_server()
    try:
        wait_health(port, first, lambda code, b: code == 200)
        stages = stage_processes(first.pid)
        launch_id = launch_of(stages["framer"])
        assert os.path.isdir(os.path.join(run_base, launch_id))
        first.kill()
        first.wait()
    finally:
        if first.poll() is None:
            first.kill()
            first.wait()
    deadline = time.monotonic() + 10
    while any(is_alive(pid) for pid in stages.values()):  # PR_SET_PDEATHSIG takes the stages down
        assert time.monotonic() < deadline
        time.sleep(0.05)
    # A dead server cannot unlink its own slab: the next one must.
    assert shm_segments(launch_id) == [f"vs-{launch_id}-coord.0-0"]

    second, port = start_server()
    try:
        wait_health(port, second, lambda code, b: code == 200)
        second_launch = launch_of(stage_processes(second.pid)["framer"])
        assert shm_segments(launch_id) == []  # swept at start-up
        assert not os.path.exists(os.path.join(run_base, launch_id))
        second.send_signal(signal.SIGTERM)
        second.wait(timeout=30)
    finally:
        if second.poll() is None:
            second.kill()
            second.wait()
    assert shm_segments(second_launch) == []
    assert not os.path.exists(os.path.join(run_base, second_launch))
