"""`make faults-long` only (not collected by `make test`: the name is not test_*.py): each stage process of
the embedded CPU default (`configs/default.yaml`: asr, thinker, talker) SIGKILLed in turn while 8
sessions take typed turns (~25 s with the start-up, real speech, 3-6 s restarts); the short version on
the stand-in pipeline is test_stage_crash.py.

A reply of the default is a second or two of compute, so the 8 turns are not all in flight at the
kill: each turn either completed before it or failed naming the dead process; at least one failed.
Then every session's next turn completes, and everything returns to its baseline."""

from __future__ import annotations

import functools
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from harness import Pipeline
from load_sessions import open_sessions, resources, talk_in_parallel, wait_baseline, wait_ready
from session_server import SessionServer, serve

from voice_server.config.loading import load_pipeline

CONFIG = Path(__file__).resolve().parents[2] / "configs" / "default.yaml"
NUM_SESSIONS = 8
QUESTION = "Tell me about the moon and the stars."


@pytest.fixture(scope="module")
def default() -> Iterator[SessionServer]:
    yield from serve(Pipeline(load_pipeline(CONFIG)), stage="thinker")


def kill_while_decoding(srv: SessionServer, process: str) -> None:
    """SIGKILL `process` once at least two replies are being decoded."""
    deadline = time.monotonic() + 30
    while resources(srv)["thinker.num_running"] < 2:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    handle = srv.pipeline.coordinator.launcher.handles[process]
    assert handle.pid is not None
    os.kill(handle.pid, signal.SIGKILL)


def test_each_default_stage_killed_while_8_sessions_talk(default: SessionServer) -> None:
    sessions = open_sessions(default, NUM_SESSIONS, max_tokens=60)
    assert all(t.status == "completed" for [t] in talk_in_parallel(sessions)), "warm-up"
    baseline = resources(default)
    for process in ("asr", "thinker", "talker"):
        handle = default.pipeline.coordinator.launcher.handles[process]
        restarts = handle.num_restarts
        kill = functools.partial(kill_while_decoding, default, process)
        done = [t for [t] in talk_in_parallel(sessions, text=QUESTION, timeout=60, during=kill)]
        failed = [t for t in done if t.status == "failed"]
        print(f"{process} killed: {len(failed)} of {NUM_SESSIONS} responses failed")
        assert failed and all(f"stage process '{process}'" in t.error and "died" in t.error for t in failed), done
        assert all(t.status in ("completed", "failed") for t in done), done
        wait_ready(default, timeout=60)
        assert handle.num_restarts == restarts + 1
        again = talk_in_parallel(sessions)
        assert all(t.status == "completed" and t.num_audio_bytes > 0 for [t] in again), again
        wait_baseline(default, baseline, timeout=30)
    for ws in sessions:
        ws.close()
    wait_baseline(default, {**baseline, "active_sessions": 0})
