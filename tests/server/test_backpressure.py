"""Backpressure with real components: a request whose consumer stops reading fails once
`max_queued_outputs` are queued and leaves the stage at once; a WebSocket client that stops reading
is dropped after `send_timeout_s` (its response aborted in the stage) instead of growing memory."""

from __future__ import annotations

import asyncio
import json
import socket
import time
from typing import Any

import pytest
from harness import Pipeline
from live_server import LiveServer, events_until, metric, speech_pipeline
from websockets.sync.client import connect

from voice_server.engine.coordinator import RequestError, SlowConsumerError
from voice_server.server.session_limits import SessionLimits

REQUEST = {"messages": [{"role": "user", "content": "hi"}]}


def stage_counters(pipeline: Pipeline) -> dict[str, int]:
    return pipeline.run(pipeline.coordinator.stats())["speech"].counters["speech"]


def wait_stage_idle(pipeline: Pipeline, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while (counters := stage_counters(pipeline))["num_running"] or counters["num_used_pages"]:
        assert time.monotonic() < deadline, counters
        time.sleep(0.05)


def test_a_consumer_that_stops_reading_fails_its_request_and_frees_the_stage() -> None:
    pipeline = speech_pipeline(step_delay_ms=2, max_queued_outputs=64)
    try:
        async def stall_then_read(stall_s: float) -> tuple[list[Any], BaseException | None]:
            stream = pipeline.coordinator.submit(REQUEST, {"sampling": {"max_tokens": 400}})
            await asyncio.sleep(stall_s)
            outputs: list[Any] = []
            try:
                async for output in stream:
                    outputs.append(output)
            except RequestError as exc:
                return outputs, exc
            return outputs, None

        outputs, error = pipeline.run(stall_then_read(0.5))
        print(f"stalled consumer: {len(outputs)} outputs, then {error!r}")
        assert isinstance(error, SlowConsumerError)
        assert str(error) == "consumer too slow: 64 outputs were queued unread (max_queued_outputs)"
        assert outputs == []  # NOTE: the backlog is dropped with the failure, not delivered first
        wait_stage_idle(pipeline)  # aborted in the stage: its sequence and pages are gone
        assert pipeline.coordinator.num_inflight == 0
        # A consumer that keeps up gets the whole reply under the same bound.
        outputs, error = pipeline.run(stall_then_read(0.0))
        assert error is None and len(outputs) == 401
    finally:
        pipeline.close()


def test_a_client_that_stops_reading_is_dropped_and_its_response_aborted() -> None:
    # NOTE: a large output bound, so what ends this session is the send timeout, not the engine bound.
    pipeline = speech_pipeline(step_delay_ms=2, max_queued_outputs=100_000)
    srv = LiveServer(pipeline, SessionLimits(send_timeout_s=1.0))
    try:
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # NOTE: before connect: a small window
        sock.connect(("127.0.0.1", srv.port))
        ws = connect(srv.ws_url, sock=sock, open_timeout=5, max_queue=4)
        # NOTE: 48 kHz output: 7.7 kB per word, so the socket buffers (MBs on loopback) fill in seconds
        # while the 4000-word reply takes longer to generate.
        ws.send(json.dumps({"type": "session.start", "output_rate": 48000,
                            "params": {"sampling": {"max_tokens": 4000}}}))
        assert json.loads(ws.recv(5))["type"] == "session.started"
        ws.send(json.dumps({"type": "text", "text": "talk for a minute"}))
        events_until(ws, "response_started")
        started = time.monotonic()  # from here on the client reads nothing
        deadline = started + 30
        while True:
            counters = stage_counters(pipeline)
            samples = srv.metrics()
            if metric(samples, "voice_server_sessions_dropped_total", endpoint="native", reason="slow_client"):
                break
            assert time.monotonic() < deadline, "the unread client was never dropped"
            time.sleep(0.1)
        took = time.monotonic() - started
        print(f"unread client dropped after {took:.1f} s; the stage just before: {counters}")
        assert counters["num_running"] == 1, "the reply was generated whole before the drop: nothing tested"
        wait_stage_idle(pipeline, timeout=2.0)  # the drop aborted the reply in the stage
        assert metric(srv.metrics(), "voice_server_active_sessions", endpoint="native") == 0
        assert metric(samples, "voice_server_responses_total", status="completed") == 0
        sock.close()
    finally:
        srv.close()
        pipeline.close()


@pytest.mark.parametrize("bound", [0, -1, True])
def test_the_output_bound_is_validated_naming_the_field(bound: Any) -> None:
    from voice_server.config import ConfigError, pipeline_from_dict

    with pytest.raises(ConfigError, match="max_queued_outputs"):
        pipeline_from_dict({"name": "x", "max_queued_outputs": bound, "stages": [
            {"name": "a", "factory": "voice_server.stages.numeric:create_echo", "terminal": True}]})
