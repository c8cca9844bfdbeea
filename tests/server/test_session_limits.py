"""Session limits and security on real servers (in-process uvicorn `VoiceServer`s over one pipeline of
real stage processes) with real WebSocket clients: bearer auth by header and by subprotocol, the
Origin allow-list, max sessions (1013 while the open session keeps working), oversize messages
(1009), the idle timeout (1000) and shutdown (1001)."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from typing import Any

import pytest
from harness import Pipeline
from live_server import LiveServer, events_until, metric, open_session, speech_pipeline
from websockets.exceptions import ConnectionClosed
from websockets.sync.client import connect

from voice_server.server.session_limits import SessionLimits

TOKEN = "s3cret-token.42"


@pytest.fixture(scope="module")
def pipeline() -> Iterator[Pipeline]:
    pipe = speech_pipeline(step_delay_ms=10)
    yield pipe
    pipe.close()


@pytest.fixture
def serve(pipeline: Pipeline) -> Iterator[Any]:
    servers: list[LiveServer] = []

    def start(**limits: Any) -> LiveServer:
        servers.append(LiveServer(pipeline, SessionLimits(**limits)))
        return servers[-1]

    yield start
    for srv in servers:
        srv.close()


def close_code(ws: Any, timeout: float = 5.0) -> tuple[int, str]:
    """The close code and reason the server sent (after any messages still queued)."""
    with pytest.raises(ConnectionClosed) as info:
        while True:
            ws.recv(timeout)
    assert info.value.rcvd is not None, "no close frame from the server"
    return info.value.rcvd.code, info.value.rcvd.reason


def talks(ws: Any) -> bool:
    """A typed turn gets a completed spoken reply."""
    ws.send(json.dumps({"type": "text", "text": "hello"}))
    events, audio = events_until(ws, "response_done")
    return events[-1]["status"] == "completed" and audio > 0


@pytest.mark.parametrize("headers,subprotocols", [
    (None, None),
    ({"Authorization": "Bearer wrong-token-1"}, None),
    ({"Authorization": f"Basic {TOKEN}"}, None),
    (None, ["realtime", "openai-insecure-api-key.wrong-token-1"]),
])
def test_a_missing_or_wrong_token_closes_with_1008(serve: Any, headers: Any, subprotocols: Any) -> None:
    srv = serve(auth_token=TOKEN)
    ws = connect(srv.ws_url, open_timeout=5, additional_headers=headers, subprotocols=subprotocols)
    code, reason = close_code(ws)
    assert (code, reason) == (1008, "missing or invalid bearer token")
    assert metric(srv.metrics(), "voice_server_sessions_refused_total", endpoint="native", reason="auth") == 1


@pytest.mark.parametrize("how", ["header", "subprotocol"])
def test_the_right_token_opens_a_session(serve: Any, how: str) -> None:
    srv = serve(auth_token=TOKEN)
    if how == "header":
        ws = connect(srv.ws_url, open_timeout=5, additional_headers={"Authorization": f"Bearer {TOKEN}"})
    else:
        ws = connect(srv.ws_url, open_timeout=5, subprotocols=[f"openai-insecure-api-key.{TOKEN}"])
        assert ws.subprotocol is None  # NOTE: the key is never echoed back as the chosen protocol
    ws.send(json.dumps({"type": "session.start", "input_rate": 16000, "params": {"sampling": {"max_tokens": 4}}}))
    assert json.loads(ws.recv(5))["type"] == "session.started"
    assert talks(ws)
    ws.close()


def test_origins_outside_the_allow_list_close_with_1008(serve: Any) -> None:
    srv = serve(allowed_origins=("https://app.example.com",))
    ws = connect(srv.ws_url, open_timeout=5, origin="https://evil.example.net")
    assert close_code(ws) == (1008, "origin not allowed")
    for origin in ("https://app.example.com", "HTTPS://APP.EXAMPLE.COM", None):  # None: not a browser
        ws = connect(srv.ws_url, open_timeout=5, origin=origin)
        ws.send(json.dumps({"type": "session.start"}))
        assert json.loads(ws.recv(5))["type"] == "session.started", origin
        ws.close()


def test_max_sessions_refuses_with_1013_while_the_open_one_keeps_working(serve: Any) -> None:
    srv = serve(max_sessions=1)
    first = open_session(srv.ws_url)
    second = connect(srv.ws_url, open_timeout=5)
    code, reason = close_code(second)
    assert code == 1013 and "1 sessions open" in reason
    assert talks(first)
    samples = srv.metrics()
    assert metric(samples, "voice_server_sessions_refused_total", endpoint="native", reason="full") == 1
    assert metric(samples, "voice_server_active_sessions", endpoint="native") == 1
    first.close()
    deadline = time.monotonic() + 5
    while True:  # the slot is free once the first session has ended
        third = connect(srv.ws_url, open_timeout=5)
        try:
            third.send(json.dumps({"type": "session.start"}))
            assert json.loads(third.recv(5))["type"] == "session.started"
            break
        except ConnectionClosed:
            assert time.monotonic() < deadline
            time.sleep(0.05)
    assert talks(third)
    third.close()


def test_a_message_over_max_message_bytes_closes_with_1009(serve: Any) -> None:
    srv = serve(max_message_bytes=64 * 1024)
    ws = open_session(srv.ws_url)
    ws.send(b"\x00" * (32 * 1024))  # under the limit: fine
    ws.send(b"\x00" * (64 * 1024 + 2))
    assert close_code(ws)[0] == 1009


def test_an_idle_session_is_closed_with_1000_and_a_reason(serve: Any) -> None:
    srv = serve(idle_timeout_s=0.5)
    ws = open_session(srv.ws_url)
    for _ in range(4):  # messages keep it open
        time.sleep(0.3)
        ws.send(json.dumps({"type": "playback", "played_ms": 0}))
    started = time.monotonic()
    code, reason = close_code(ws)
    assert (code, reason) == (1000, "idle timeout: no message for 0.5 s")
    assert 0.3 < time.monotonic() - started < 2.0
    assert metric(srv.metrics(), "voice_server_sessions_dropped_total", endpoint="native", reason="idle") == 1


def test_shutdown_closes_open_sessions_with_1001_and_frees_the_stage(serve: Any, pipeline: Pipeline) -> None:
    srv = serve()
    idle = open_session(srv.ws_url)
    talking = open_session(srv.ws_url, params={"sampling": {"max_tokens": 400}})
    talking.send(json.dumps({"type": "text", "text": "go on forever"}))
    events_until(talking, "response_started")
    srv.server.should_exit = True
    for ws in (idle, talking):
        assert close_code(ws, timeout=10) == (1001, "server shutting down")
    srv.task.result(15)
    samples = srv.metrics(is_served=False)
    assert metric(samples, "voice_server_responses_total", status="cancelled") == 1
    assert metric(samples, "voice_server_sessions_dropped_total", endpoint="native", reason="shutdown") == 2
    assert metric(samples, "voice_server_active_sessions", endpoint="native") == 0
    counters = pipeline.run(pipeline.coordinator.stats())["speech"].counters["speech"]
    deadline = time.monotonic() + 10
    while counters["num_running"] or counters["num_used_pages"]:  # the response was aborted in the stage
        assert time.monotonic() < deadline, counters
        time.sleep(0.05)
        counters = pipeline.run(pipeline.coordinator.stats())["speech"].counters["speech"]
