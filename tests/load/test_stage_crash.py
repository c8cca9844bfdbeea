"""A stage process SIGKILLed while 8 sessions talk (6 native ones with spoken turns, whose audio and
replies travel through the relay, and 2 Realtime ones with typed turns): every response in flight
ends with a failed `response_done` (Realtime: `response.done` with status `failed`) naming the dead
process, the sessions stay open, the supervisor restarts the stage, the next turn of every session
completes, and no request, KV page, relay slot or `/dev/shm` segment is left behind.

NOTE: the two-process stand-in speech pipeline (`load_sessions.two_stage_pipeline`), not
`configs/default.yaml`: its stages restart in well under a second and its replies last as long as the
test asks, so all 8 are mid-reply at each kill, in ~15 s of test with no model on 2 cores. The default
(its 3-6 s restarts, 7 s start, real speech) is `long_default_crash.py`, in `make faults-long`."""

from __future__ import annotations

import functools
import os
import signal
import time
from collections.abc import Iterator

import numpy as np
import pytest
from live_server import metric
from load_sessions import open_sessions, resources, talk_in_parallel, two_stage_pipeline, wait_baseline, wait_ready
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


def kill_when_all_stream(srv: SessionServer, process: str, num_responses: int) -> None:
    """SIGKILL `process` once `num_responses` responses are streaming from the speech stage."""
    deadline = time.monotonic() + 30
    while resources(srv)["speech.num_running"] < num_responses:
        assert time.monotonic() < deadline, resources(srv)
        time.sleep(0.01)
    handle = srv.pipeline.coordinator.launcher.handles[process]
    assert handle.pid is not None
    os.kill(handle.pid, signal.SIGKILL)


def test_each_stage_killed_while_8_sessions_talk(server: SessionServer) -> None:
    sessions = open_sessions(server, NUM_NATIVE, max_tokens=MAX_TOKENS, turn_detection=None)
    for _ in range(NUM_REALTIME):
        sessions.append(RealtimeClient(server.port))
        sessions[-1].update(max_output_tokens=MAX_TOKENS)
    first = [t for [t] in talk_in_parallel(sessions, audio=AUDIO)]
    assert all(t.status == "completed" for t in first), first
    assert all(t.text.startswith(" m1a1 ") for t in first[:NUM_NATIVE]), first  # the audio reached the stage
    baseline = resources(server)
    assert baseline["speech.requests"] == 0 and baseline["coordinator.inflight"] == 0, baseline
    for _ in range(ROUNDS):
        for process in ("front", "speech"):
            handle = server.pipeline.coordinator.launcher.handles[process]
            restarts = handle.num_restarts
            kill = functools.partial(kill_when_all_stream, server, process, len(sessions))
            turns = [t for [t] in talk_in_parallel(sessions, audio=AUDIO, during=kill)]
            for turn in turns:
                assert turn.status == "failed" and f"stage process '{process}'" in turn.error, turn
                assert "died" in turn.error and turn.num_audio_bytes > 0, turn  # cut mid-reply
            wait_ready(server)
            assert handle.num_restarts == restarts + 1
            samples = server.metrics()  # NOTE: what an operator's alert sees
            assert metric(samples, "voice_server_stage_restarts_total", stage=process) == restarts + 1
            assert metric(samples, "voice_server_pipeline_ready") == 1
            again = [t for [t] in talk_in_parallel(sessions, audio=AUDIO)]  # the same sessions, served again
            assert all(t.status == "completed" and t.num_audio_bytes > 0 for t in again), again
            wait_baseline(server, baseline)
    for session in sessions:
        session.close()
    wait_baseline(server, {**baseline, "active_sessions": 0})
