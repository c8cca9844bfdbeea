"""Issue #20 against the real CLI in a subprocess: `serve` refuses what `check-config` refuses, before it
starts anything and with the same message; a second stop signal while stopping is one calm log line; a stop
signal early in start-up (imports, the config check) exits 0 with no traceback and leaves nothing behind."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
from harness import children_of, shm_segments, wait_gone
from serving import NUMERIC_CONFIG, free_port, health_status  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]


def cli(*args: str, run_dir: Path | None = None, path: Path = ROOT) -> subprocess.Popen[str]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(path), os.environ.get("PYTHONPATH", "")])}
    if run_dir is not None:
        env["VOICE_SERVER_RUN_DIR"] = str(run_dir)  # NOTE: this server's launches only, not other tests'
    return subprocess.Popen([sys.executable, "-m", "voice_server.cli", *args], cwd=ROOT, env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def numeric_config(tmp_path: Path, old: str = "", new: str = "") -> Path:
    text = NUMERIC_CONFIG.read_text()
    assert old in text
    path = tmp_path / "pipeline.yaml"
    path.write_text(text.replace(old, new, 1))
    return path


# NOTE: one index past the devices this host has, so the refusal holds on a GPU host too.
ABSENT_CUDA = f"cuda:{torch.cuda.device_count()}"


@pytest.mark.parametrize("old, new, field", [
    ("    terminal: true\n", f"    terminal: true\n    device: {ABSENT_CUDA}\n",
     f"field 'device': {ABSENT_CUDA} is not on this host"),
    ("numeric:create_sink", "no_such_module:create", "field 'factory': cannot import module"),
], ids=["absent-cuda", "missing-factory"])
def test_serve_refuses_what_check_config_refuses_with_its_message(
    tmp_path: Path, old: str, new: str, field: str
) -> None:
    config = numeric_config(tmp_path, old, new)
    checked = cli("check-config", str(config))
    _, check_err = checked.communicate(timeout=120)
    assert checked.returncode == 2
    expected = check_err.strip()
    assert expected.startswith("config error: stage 'sink': ") and field in expected, expected

    run_dir = tmp_path / "run"
    started = time.monotonic()
    served = cli("serve", "--config", str(config), "--port", str(free_port()), "--log-level", "info", run_dir=run_dir)
    spawned: set[int] = set()
    try:
        while served.poll() is None and time.monotonic() < started + 60:
            spawned.update(children_of(served.pid))
            time.sleep(0.01)
    finally:
        if served.poll() is None:
            served.terminate()  # NOTE: it started anyway (the bug): a clean stop removes what it made
        out, err = served.communicate(timeout=30)
    took = time.monotonic() - started
    print(f"serve exited {served.returncode} after {took:.1f} s; stderr:\n{err}")
    assert served.returncode == 2 and took < 30
    assert err.strip().splitlines() == [expected]  # NOTE: nothing logged: no port, no stage started
    assert out == ""
    assert not run_dir.exists() or os.listdir(run_dir) == []
    assert len(spawned) <= 1 and wait_gone(list(spawned), 5.0) == []  # the config check's child, if seen


@pytest.mark.parametrize("stop_signal", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_a_second_stop_signal_while_stopping_is_one_calm_line(tmp_path: Path, stop_signal: int) -> None:
    port = free_port()
    server = cli("serve", "--config", str(NUMERIC_CONFIG), "--port", str(port), "--log-level", "info",
                 run_dir=tmp_path / "run")
    try:
        deadline = time.monotonic() + 60
        while health_status(port) != 200:
            assert server.poll() is None and time.monotonic() < deadline, "server not healthy"
            time.sleep(0.05)
        children = children_of(server.pid)
        server.send_signal(stop_signal)
        # NOTE: well inside uvicorn's shutdown (it polls for the stop every 0.1 s, then waits 0.1 s more),
        # where the second signal makes it skip the app's lifespan shutdown: that left the lifespan task to be
        # cancelled at exit, logged by uvicorn as an ERROR with a CancelledError traceback.
        time.sleep(0.05)
        server.send_signal(stop_signal)
        _, err = server.communicate(timeout=30)
    finally:
        if server.poll() is None:
            server.kill()
            server.communicate()
    name = signal.Signals(stop_signal).name
    print(err[-3000:])
    assert server.returncode == 0
    assert "Traceback" not in err and " ERROR " not in err and "CancelledError" not in err
    assert err.count(f"{name} received again: already stopping") == 1
    assert wait_gone(children, 5.0) == []


def _caught_signals(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1], 16) for line in f if line.startswith("SigCgt:"))


class _Watcher:
    """Every child and launch of a server process while it runs, so the test can tell that none outlived it."""

    def __init__(self, pid: int, run_dir: Path) -> None:
        self.pid, self.run_dir = pid, run_dir
        self.children: set[int] = set()
        self.launches: set[str] = set()
        self._is_done = threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True)
        self._thread.start()

    def _watch(self) -> None:
        while not self._is_done.is_set():
            self.children.update(children_of(self.pid))
            if self.run_dir.is_dir():
                self.launches.update(name.lstrip(".") for name in os.listdir(self.run_dir))  # NOTE: `.ID` while staged
            time.sleep(0.005)

    def stop(self) -> None:
        self._is_done.set()
        self._thread.join()


# NOTE: delays from when the interpreter took SIGINT over (its start: the first ~40 ms, site and runpy,
# come before any of the project's code and are Python's to report), or from when `serve` took SIGTERM
# over (its first act). Through ~1.5 s the imports and the config check run, then the loop starts.
EARLY_STOPS = [
    *((signal.SIGINT, "python", d) for d in (0.3, 0.6, 0.9)),
    *((signal.SIGINT, "serve", d) for d in (0.0, 0.1, 0.2, 0.4, 0.7, 1.2)),
    *((signal.SIGTERM, "serve", d) for d in (0.0, 0.3, 0.8)),
]


@pytest.mark.parametrize("stop_signal, anchor, delay_s", EARLY_STOPS,
                         ids=[f"{signal.Signals(s).name}-{a}+{d}s" for s, a, d in EARLY_STOPS])
def test_a_stop_signal_early_in_start_up_exits_0_without_a_traceback(
    tmp_path: Path, stop_signal: int, anchor: str, delay_s: float
) -> None:
    run_dir = tmp_path / "run"
    server = cli("serve", "--config", str(NUMERIC_CONFIG), "--port", str(free_port()), "--log-level", "info",
                 run_dir=run_dir)
    watcher = _Watcher(server.pid, run_dir)
    try:
        held = signal.SIGINT if anchor == "python" else signal.SIGTERM
        deadline = time.monotonic() + 30
        while not _caught_signals(server.pid) & (1 << (held - 1)):
            assert server.poll() is None and time.monotonic() < deadline, server.communicate()[1]
            time.sleep(0.001)
        time.sleep(delay_s)
        server.send_signal(stop_signal)
        _, err = server.communicate(timeout=30)
    finally:
        watcher.stop()
        if server.poll() is None:
            server.kill()
            server.communicate()
    print(f"{signal.Signals(stop_signal).name} {delay_s} s after {anchor} held it: exit {server.returncode}, "
          f"children {sorted(watcher.children)}, launches {sorted(watcher.launches)}\n{err[-2000:]}")
    assert server.returncode == 0
    assert "Traceback" not in err and " ERROR " not in err
    assert wait_gone(list(watcher.children), 5.0) == []
    assert [name for launch in watcher.launches for name in shm_segments(launch)] == []
    assert not run_dir.exists() or os.listdir(run_dir) == []


def test_a_stop_signal_while_a_stage_is_slow_to_stop_leaves_nothing_behind(tmp_path: Path) -> None:
    config = tmp_path / "stubborn.yaml"
    config.write_text(
        "name: stubborn\nstartup_timeout_s: 60\nstages:\n"
        "  - {name: slow, factory: 'stubborn_factory:create', terminal: true, memory_fraction: 0.01}\n"
    )
    run_dir = tmp_path / "run"
    port = free_port()
    server = cli("serve", "--config", str(config), "--port", str(port), "--log-level", "info", run_dir=run_dir,
                 path=Path(__file__).parent)
    watcher = _Watcher(server.pid, run_dir)
    try:
        deadline = time.monotonic() + 60
        while b'"loading weights"' not in _health_body(port):
            assert server.poll() is None and time.monotonic() < deadline, server.communicate()[1]
            time.sleep(0.05)
        started = time.monotonic()
        server.send_signal(signal.SIGINT)
        # NOTE: uvicorn stops in well under a second; the stage only when the launcher's grace (5 s) ends in
        # SIGKILL. A second cancel of the start, once uvicorn had stopped, cut short the cleanup it was running.
        _, err = server.communicate(timeout=30)
        took = time.monotonic() - started
    finally:
        watcher.stop()
        if server.poll() is None:
            server.kill()
            server.communicate()
    print(f"exit {server.returncode} {took:.1f} s after SIGINT; launches {sorted(watcher.launches)}\n{err[-2000:]}")
    assert server.returncode == 0
    assert "Traceback" not in err and " ERROR " not in err
    assert wait_gone(list(watcher.children), 5.0) == []
    assert len(watcher.launches) == 1
    assert [name for launch in watcher.launches for name in shm_segments(launch)] == []
    assert os.listdir(run_dir) == []


def _health_body(port: int) -> bytes:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as resp:
            return bytes(resp.read())
    except urllib.error.HTTPError as exc:
        return bytes(exc.read())
    except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
        return b""
