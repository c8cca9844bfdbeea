"""The locust load test (`loadtest/locustfile.py`) against a real server: uvicorn on 127.0.0.1 over the
stand-in speech stage (real stage processes), locust as real processes (headless; and once distributed,
a master and a worker on 127.0.0.1). Each endpoint's users must report every turn entry, with no failure."""

from __future__ import annotations

import csv
import json
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests" / "server"))
from session_server import SessionServer, serve  # noqa: E402

from voice_server.session.twilio.settings import TwilioSettings  # noqa: E402

MAX_TOKENS = 24  # NOTE: ~1.9 s of reply audio: long enough to be spoken over after the listener's pause
ENTRIES = ("time_to_first_audio", "turn", "underrun", "gen_ms_per_audio_s", "barge_in")


@pytest.fixture(scope="module")
def server() -> Iterator[SessionServer]:
    for srv in serve():
        # NOTE: Twilio calls cannot send request params: the server's settings bound their replies.
        srv.app.state.twilio = TwilioSettings(params=(("sampling", {"max_tokens": MAX_TOKENS}),))
        yield srv


@pytest.fixture(scope="module")
def utterances(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("utterances")
    subprocess.run([sys.executable, str(ROOT / "loadtest" / "make_utterances.py"), "--out", str(out), "--count", "2"],
                   check=True, env=_env())
    return out


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}


def _locust(server: SessionServer, utterances: Path, prefix: Path, users: int, endpoint: str,
            *mode: str) -> dict[tuple[str, str], dict[str, str]]:
    common = ["-f", str(ROOT / "loadtest" / "locustfile.py")]
    options = ["--endpoint", endpoint, "--barge-in", "1.0", "--max-tokens", str(MAX_TOKENS),
               "--utterances", str(utterances), "--reply-timeout", "20"]
    master = [sys.executable, "-m", "locust", *common, "--headless", "-u", str(users), "-r", str(users), "-t", "15s",
              "--host", f"http://127.0.0.1:{server.port}", "--csv", str(prefix), "--only-summary",
              "--stop-timeout", "10", *options, *mode]
    workers = []
    if mode:
        workers = [subprocess.Popen([sys.executable, "-m", "locust", *common, "--worker", "--master-host", "127.0.0.1",
                                     "--master-port", mode[-1]], env=_env(), cwd=ROOT)]
    try:
        run = subprocess.run(master, env=_env(), cwd=ROOT, capture_output=True, text=True, timeout=120)
    finally:
        for worker in workers:
            worker.wait(30)
    with open(f"{prefix}_stats.csv") as f:
        rows = {(row["Type"], row["Name"]): row for row in csv.DictReader(f)}
    assert run.returncode == 0, run.stderr[-3000:]
    return rows


def _check(rows: dict[tuple[str, str], dict[str, str]], endpoints: list[str]) -> None:
    for endpoint in endpoints:
        for name in ENTRIES:
            row = rows.get((endpoint, name))
            assert row is not None and int(row["Request Count"]) > 0, (endpoint, name, sorted(rows))
    assert int(rows[("", "Aggregated")]["Failure Count"]) == 0, rows


def test_each_endpoint(server: SessionServer, utterances: Path, tmp_path: Path) -> None:
    """Two users per endpoint (`/ws`, `/v1/realtime`, `/twilio/media`) in one headless run."""
    endpoints = ["ws", "realtime", "twilio"]
    _check(_locust(server, utterances, tmp_path / "all", 6, ",".join(endpoints)), endpoints)
    # NOTE: and the report of that run (what `loadtest/run_locust.py` would record is written here).
    (tmp_path / "all_run.json").write_text(json.dumps({"users": 6, "config": "speech-test", "command": "locust"}))
    report = subprocess.run([sys.executable, str(ROOT / "loadtest" / "report.py"), str(tmp_path / "all"), "--img",
                             str(tmp_path / "img")], env=_env(), cwd=ROOT, capture_output=True, text=True, check=True)
    for endpoint in endpoints:
        assert f"| speech-test | {endpoint} | 6 |" in report.stdout, report.stdout
    assert sorted(p.name for p in (tmp_path / "img").iterdir()) == ["loadtest-first-audio.png", "loadtest-rtf.png"]
    # The same run standing in for a `--one-process` run of the same config adds the processes plot.
    for suffix in ("_stats.csv", "_run.json"):
        shutil.copy(tmp_path / f"all{suffix}", tmp_path / f"one{suffix}")
    (tmp_path / "one_run.json").write_text(json.dumps({"users": 6, "config": "speech-test-one-process",
                                                       "command": "locust"}))
    report = subprocess.run([sys.executable, str(ROOT / "loadtest" / "report.py"), str(tmp_path / "all"),
                             str(tmp_path / "one"), "--img", str(tmp_path / "img")], env=_env(), cwd=ROOT,
                            capture_output=True, text=True, check=True)
    assert "| speech-test-one-process | ws | 6 |" in report.stdout, report.stdout
    assert (tmp_path / "img" / "loadtest-processes.png").stat().st_size > 10_000


def test_distributed(server: SessionServer, utterances: Path, tmp_path: Path) -> None:
    """A master and one worker on 127.0.0.1 (the worker runs the users; the master writes the CSV)."""
    from serving import free_port

    port = str(free_port())
    rows = _locust(server, utterances, tmp_path / "dist", 2, "ws,twilio", "--master", "--master-bind-host",
                   "127.0.0.1", "--expect-workers", "1", "--master-bind-port", port)
    _check(rows, ["ws", "twilio"])
