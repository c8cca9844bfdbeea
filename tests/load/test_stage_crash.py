"""A stage process SIGKILLed while 8 sessions talk (6 native ones with spoken turns, whose audio and
replies travel through the relay, and 2 Realtime ones with typed turns): every response in flight
ends with a failed `response_done` (Realtime: `response.done` with status `failed`) naming the dead
process, the sessions stay open, the supervisor restarts the stage,
the next turn of every session completes, and no request, KV page, relay slot or `/dev/shm` segment
is left behind.

NOTE: the two-process stand-in speech pipeline (`load_sessions.two_stage_pipeline`), not
`configs/default.yaml`: its stages restart in well under a second, so killing each in turn stays a
few seconds of test; the default's 3-6 s restarts and real speech would make it a minute."""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Iterator

import numpy as np
import pytest
from load_sessions import (
    Turn,
    open_sessions,
    resources,
    take_turn,
    two_stage_pipeline,
    wait_baseline,
    wait_ready,
)
from realtime_client import RealtimeClient
from session_server import SessionServer, serve

from voice_server.audio import float32_to_pcm16, pcm16_to_bytes

NUM_NATIVE, NUM_REALTIME = 6, 2
MAX_TOKENS = 150  # NOTE: ~4.5 s per reply: all 8 overlap even when a busy machine staggers their starts
AUDIO = pcm16_to_bytes(float32_to_pcm16(0.3 * np.sin(np.arange(8000) * 2 * np.pi * 200 / 16000).astype(np.float32)))
"""Half a second of a 200 Hz tone at 16 kHz: each spoken turn puts 16 KB of audio into the history."""
ROUNDS = int(os.environ.get("VOICE_SERVER_FAULT_ROUNDS", "1"))
"""Kills of each stage process (`make faults-long` runs more)."""


@pytest.fixture(scope="module")
def server() -> Iterator[SessionServer]:
    # NOTE: a low inline threshold puts every array (the turns' audio, the replies' PCM) in the relay
    yield from serve(two_stage_pipeline(step_delay_ms=30, inline_threshold_bytes=1024))


def turns_in_parallel(sessions: list[object]) -> list[Turn]:
    """Each session takes one turn in its own thread."""
    return kill_mid_response(None, "", sessions)


def kill_mid_response(srv: SessionServer | None, process: str, sessions: list[object]) -> list[Turn]:
    """Each session starts a turn; once every response is streaming, SIGKILL `process` (with a server)."""
    turns: list[Turn | None] = [None] * len(sessions)

    def run(i: int) -> None:
        turns[i] = take_turn(sessions[i], AUDIO)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(sessions))]
    for t in threads:
        t.start()
    if srv is None:
        for t in threads:
            t.join(30)
        return [t for t in turns if t is not None]
    deadline = time.monotonic() + 30
    while resources(srv)["speech.num_running"] < len(sessions):  # NOTE: all 8 are mid-response now
        assert time.monotonic() < deadline, resources(srv)
        time.sleep(0.01)
    handle = srv.pipeline.coordinator.launcher.handles[process]
    assert handle.pid is not None
    os.kill(handle.pid, signal.SIGKILL)
    for t in threads:
        t.join(30)
    assert all(t is not None for t in turns)
    return [t for t in turns if t is not None]


def test_each_stage_killed_while_8_sessions_talk(server: SessionServer) -> None:
    sessions = open_sessions(server, NUM_NATIVE, max_tokens=MAX_TOKENS, turn_detection=None)
    for _ in range(NUM_REALTIME):
        sessions.append(RealtimeClient(server.port))
        sessions[-1].update(max_output_tokens=MAX_TOKENS)
    first = turns_in_parallel(sessions)
    assert all(t.status == "completed" for t in first), first
    assert all(t.text.startswith(" m1a1 ") for t in first[:NUM_NATIVE]), first  # the audio reached the stage
    baseline = resources(server)
    assert baseline["speech.requests"] == 0 and baseline["coordinator.inflight"] == 0, baseline
    for _ in range(ROUNDS):
        for process in ("front", "speech"):
            handle = server.pipeline.coordinator.launcher.handles[process]
            restarts = handle.num_restarts
            turns = kill_mid_response(server, process, sessions)
            for turn in turns:
                assert turn.status == "failed" and f"stage process '{process}'" in turn.error, turn
                assert "died" in turn.error and turn.num_audio_bytes > 0, turn  # cut mid-reply
            wait_ready(server)
            assert handle.num_restarts == restarts + 1
            again = turns_in_parallel(sessions)  # the same sessions: still open, and served again
            assert all(t.status == "completed" and t.num_audio_bytes > 0 for t in again), again
            wait_baseline(server, baseline)
    for session in sessions:
        session.close()
    wait_baseline(server, {**baseline, "active_sessions": 0})
