"""Turn-taking on the embedded CPU default (`semantic_vad`: Silero VAD, Smart Turn, speculative responses)
through a real server and real stage processes, with speech synthesised at test time:

- a complete question is answered once, and its response was started speculatively at the pause;
- a sentence with a hesitation at a comma is answered once, after the whole sentence: the pause's
  speculative response is thrown away when the speaker goes on, and leaves nothing behind in any stage
  (requests, KV pages, relay slots);
- what the response reports (`end_of_speech`, `first_audible`) and `/metrics` count agree."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from harness import Pipeline
from live_server import metric
from session_server import SessionServer, serve
from speech_text import ASR_RATE, hesitant_speech, speech, word_error_rate
from test_default_pipeline import SpokenTurn
from websockets.sync.client import ClientConnection, connect

from voice_server.audio import float32_to_pcm16, pcm16_to_bytes
from voice_server.config.loading import load_pipeline

CONFIG = Path(__file__).resolve().parents[2] / "configs" / "default.yaml"
FRAME = ASR_RATE // 50


@pytest.fixture(scope="module")
def default() -> Iterator[SessionServer]:
    pipeline = load_pipeline(CONFIG)
    assert pipeline.turn_detection == "semantic_vad"
    yield from serve(Pipeline(pipeline), stage="thinker")


def open_session(port: int) -> ClientConnection:
    ws = connect(f"ws://127.0.0.1:{port}/ws", open_timeout=5, max_size=None)
    ws.send(json.dumps({"type": "session.start", "input_rate": ASR_RATE, "output_rate": 24000}))
    started = json.loads(ws.recv(10))
    assert started["turn_detection"] == "semantic_vad", started  # NOTE: the pipeline's default
    return ws


def say(ws: ClientConnection, audio: np.ndarray) -> SpokenTurn:
    """`audio` at real-time pace, then silence until the response is done (a live microphone)."""
    turn = SpokenTurn(ws)
    pcm = float32_to_pcm16(audio)
    frames = [pcm[i:i + FRAME] for i in range(0, len(pcm), FRAME)]
    silence = np.zeros(FRAME, np.int16)
    start = time.monotonic()
    for i in range(10_000):
        if i >= len(frames) and turn.done.is_set():
            break
        ws.send(pcm16_to_bytes(frames[i] if i < len(frames) else silence))
        time.sleep(max(0.0, start + (i + 1) * 0.02 - time.monotonic()))
        assert time.monotonic() - start < 60, turn.events
    turn.thread.join(5)
    return turn


def assert_nothing_left(srv: SessionServer) -> None:
    """No request, KV page (beyond the prefix cache's), or relay slot held anywhere once the turn is over."""
    coordinator = srv.pipeline.coordinator
    deadline = time.monotonic() + 15
    while True:
        stats = srv.pipeline.run(coordinator.stats())
        held = {"coordinator.inflight": coordinator.num_inflight,
                "coordinator.relay_slots": coordinator.slab.num_live_slots}
        for process, reply in stats.items():
            held[f"{process}.requests"] = sum(len(ids) for ids in reply.active.values())
            held[f"{process}.relay_slots"] = reply.num_live_slots
        if not any(held.values()):
            break
        assert time.monotonic() < deadline, held
        time.sleep(0.1)
    srv.wait_idle(timeout=15)


def test_a_complete_question_is_answered_once_from_a_speculative_start(default: SessionServer) -> None:
    before = default.metrics()
    ws = open_session(default.port)
    turn = say(ws, speech("What is the capital of France?", silence_s=0.3))
    done = turn.events[-1]
    assert done["type"] == "response_done" and done["status"] == "completed", turn.events
    assert [e["type"] for e in turn.events].count("response_started") == 1
    assert "paris" in done["text"].lower()
    timings = done["timings_ms"]
    # NOTE: started at the pause, before the commit: the transcript was final before the turn ended.
    assert timings["transcript"] < 0 and timings["end_of_speech"] < 0, timings
    assert timings["first_audio_sent"] <= timings["first_audible"]
    after = default.metrics()
    started = metric(after, "voice_server_speculative_responses_total", outcome="started") - metric(
        before, "voice_server_speculative_responses_total", outcome="started")
    assert started >= 1
    gap = "voice_server_reply_gap_seconds_count"
    assert metric(after, gap) > metric(before, gap)
    ws.close()
    assert_nothing_left(default)


def test_a_hesitation_is_not_a_turn_end_and_its_speculation_leaves_nothing_behind(default: SessionServer) -> None:
    text = "I would like to book a, table for two people tonight."
    before = default.metrics()
    ws = open_session(default.port)
    turn = say(ws, hesitant_speech(text, pause_s=0.7))
    kinds = [e["type"] for e in turn.events]
    assert kinds.count("response_started") == 1 and kinds.count("speech_stopped") == 1, kinds
    transcript = turn.of("input_transcript_done")[-1]["transcript"]
    # NOTE: the committed turn holds the words after the pause: it ended with the sentence, not at the comma.
    assert "tonight" in transcript and word_error_rate(text, transcript) <= 0.35, transcript
    assert turn.events[-1]["status"] == "completed"
    after = default.metrics()
    discarded = metric(after, "voice_server_speculative_responses_total", outcome="discarded") - metric(
        before, "voice_server_speculative_responses_total", outcome="discarded")
    print(f"transcript {transcript!r}, speculations discarded {discarded}, timings {turn.events[-1]['timings_ms']}")
    ws.close()
    assert_nothing_left(default)
