"""Fuzz end to end: random JSON, binary and garbage frames on every session endpoint of a real server
(uvicorn on 127.0.0.1 over the stand-in speech stage) get only documented error events or close codes;
the server logs no exception and still serves a well-behaved session of each protocol afterwards.

Documented outcomes: `/ws` (``voice_server/session/native.py``) answers a bad first message with close
1008 and a bad later message with an ``error`` event (codes below); `/v1/realtime` answers ``error``
events whose code is in ``ERROR_CODES`` (each event checked against the OpenAI SDK's schema by
``RealtimeClient``); `/twilio/media` ignores a frame or closes with 1003, 1008 or 1009 (the table in
``voice_server/session/twilio/messages.py``), 1000 after ``stop``. Each sequence ends with a barrier (a
message the server must answer, or a ``stop``), so a hang is a failure, not a slow pass.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from typing import Any

import pytest
from fuzz.test_fuzz_realtime import EVENTS as REALTIME_EVENTS
from fuzz.test_fuzz_twilio import MESSAGES as TWILIO_MESSAGES
from fuzz_values import FUZZ_EXAMPLES, frames, json_values, numbers, scalars, shaped
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from live_server import events_until, stream_audio
from realtime_client import RealtimeClient
from session_server import SessionServer
from speech_signals import signal_of
from twilio_phone import Phone
from websockets.exceptions import ConnectionClosed
from websockets.sync.client import ClientConnection, connect

from voice_server.session.realtime import ERROR_CODES

# NOTE: each example is one connection carrying a sequence of frames: 25 x ~20 = ~500 frames an endpoint.
E2E = settings(max_examples=max(25, FUZZ_EXAMPLES // 6), deadline=None,
               suppress_health_check=list(HealthCheck))
NATIVE_CODES = {"invalid_json", "invalid_value", "unknown_event", "no_response", "invalid_audio",
                "input_audio_buffer_commit_empty", "pipeline_unavailable", "pipeline_overloaded"}
NATIVE_WORDS = ["input.commit", "input.clear", "text", "response.create", "response.cancel", "playback", "type",
                "respond", "played_ms", "hello", "session.start"]
ANY = st.one_of(numbers(), scalars(NATIVE_WORDS))
NATIVE_CONTROL = shaped({"text": ANY, "respond": ANY, "played_ms": ANY}, NATIVE_WORDS,
                        {"type": st.one_of(st.sampled_from(NATIVE_WORDS[:6]), ANY)})
NATIVE_FRAMES = st.one_of(frames(st.one_of(NATIVE_CONTROL, json_values(NATIVE_WORDS))),
                          st.binary(min_size=1, max_size=1280))
START_WORDS = ["type", "session.start", "input_rate", "output_rate", "instructions", "turn_detection", "params",
               "sampling", "max_tokens", "threshold", "silence_duration_ms", "prefix_padding_ms"]
NATIVE_STARTS = frames(shaped({key: st.one_of(numbers(), json_values(START_WORDS)) for key in START_WORDS[2:7]},
                              START_WORDS, {"type": st.just("session.start")}))


class LogRecords(logging.Handler):
    """Every record of the server's loggers (uvicorn's do not propagate to the root), for the checks."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)

    def failures(self) -> list[str]:
        """Exceptions and errors logged since the last call (so one failing test does not fail the next)."""
        records, self.records = self.records, []
        return [f"{r.name}: {r.getMessage()}" for r in records if r.exc_info or r.levelno >= logging.ERROR]


@pytest.fixture(scope="module")
def log_records() -> Iterator[LogRecords]:
    handler = LogRecords()
    loggers = [logging.getLogger(), logging.getLogger("uvicorn"), logging.getLogger("uvicorn.error")]
    for logger in loggers:
        logger.addHandler(handler)
    yield handler
    for logger in loggers:
        logger.removeHandler(handler)


def close_code(exc: ConnectionClosed) -> int | None:
    return None if exc.rcvd is None else int(exc.rcvd.code)


def native_barrier(ws: ClientConnection, mark: str) -> list[dict[str, Any]]:
    """Events up to the server's answer to an unknown message type `mark` (messages are handled in order)."""
    ws.send(json.dumps({"type": mark}))
    events = []
    while True:
        message = ws.recv(20)
        if isinstance(message, bytes):
            continue
        event = json.loads(message)
        if event["type"] == "error" and mark in event["message"]:
            return events
        events.append(event)


@E2E
@given(first=st.one_of(st.none(), NATIVE_STARTS), sequence=st.lists(NATIVE_FRAMES, min_size=10, max_size=30))
@example(first="[" * 5000, sequence=[])  # was a RecursionError out of the endpoint (an ASGI exception)
@example(first=None, sequence=["{\"a\":" * 3000])  # the same in a control message: it ended the session
def test_native_ws_answers_random_frames_with_documented_errors(
        server: SessionServer, log_records: LogRecords, first: str | bytes | None, sequence: list[str | bytes]) -> None:
    with connect(server.ws_url, open_timeout=5, max_size=None) as ws:
        ws.send(first if first is not None else json.dumps({
            "type": "session.start", "input_rate": 16000, "turn_detection": None,
            "params": {"sampling": {"max_tokens": 4}}}))
        try:
            started = json.loads(ws.recv(10))
        except ConnectionClosed as exc:
            assert close_code(exc) in (1008, 1009), exc
            return
        assert started["type"] == "session.started", started
        try:
            for frame in sequence:
                ws.send(frame)
            events = native_barrier(ws, "fuzz-barrier")
        except ConnectionClosed as exc:
            assert close_code(exc) == 1009, exc  # NOTE: the only close a started session may get
            return
    for event in events:
        if event["type"] == "error":
            assert event["code"] in NATIVE_CODES, event
    assert (failures := log_records.failures()) == [], failures


@E2E
@given(st.lists(frames(REALTIME_EVENTS), min_size=10, max_size=30))
def test_realtime_answers_random_frames_with_documented_errors(
        server: SessionServer, log_records: LogRecords, sequence: list[str | bytes]) -> None:
    client = RealtimeClient(server.port)
    try:
        for frame in sequence:
            client.ws.send(frame)
        client.send("fuzz.barrier", event_id="evt_fuzz_barrier")
        while True:
            event = client.next(20)  # NOTE: checked against the SDK's server-event schema
            if event["type"] == "error":
                assert event["error"]["code"] in ERROR_CODES, event
                if event["error"].get("event_id") == "evt_fuzz_barrier":
                    break
    finally:
        client.close()
    assert (failures := log_records.failures()) == [], failures


@E2E
@given(is_started=st.booleans(), sequence=st.lists(frames(TWILIO_MESSAGES), min_size=10, max_size=30))
def test_twilio_closes_random_streams_with_documented_codes(
        server: SessionServer, log_records: LogRecords, is_started: bool, sequence: list[str | bytes]) -> None:
    phone = Phone(server.port)
    try:
        if is_started:
            phone.start()
        for frame in sequence:
            phone.ws.send(frame)
        phone.seq = 10**17  # NOTE: past any random sequenceNumber, so the stop is not taken for a replay
        phone.stop()
    except ConnectionClosed:
        pass  # NOTE: a fatal frame closed it already; the code is checked below
    # NOTE: every sequence ends closed: stop (1000), or a fatal frame, or a stop before any start (1008).
    assert phone.closed_with(20) in (1000, 1003, 1008, 1009)
    assert (failures := log_records.failures()) == [], failures


def test_after_the_fuzzing_every_endpoint_still_serves_a_good_session(server: SessionServer,
                                                                     log_records: LogRecords) -> None:
    turn = signal_of(16000, ("noise", 300), ("voice", 900), ("noise", 700))
    with connect(server.ws_url, open_timeout=5) as ws:
        ws.send(json.dumps({"type": "session.start", "input_rate": 16000,
                            "params": {"sampling": {"max_tokens": 6}}}))
        assert json.loads(ws.recv(5))["type"] == "session.started"
        stream_audio(ws, turn, pace=4.0)
        events, audio = events_until(ws, "response_done", 30)
        assert events[-1]["status"] == "completed" and audio > 0, events
    client = RealtimeClient(server.port)
    client.send("conversation.item.create", item={"type": "message", "role": "user",
                                                  "content": [{"type": "input_text", "text": "hi"}]})
    client.send("response.create", response={"max_output_tokens": 4})
    assert client.until("response.done", 30)[-1]["response"]["status"] == "completed"
    client.close()
    server.wait_idle()
    assert (failures := log_records.failures()) == [], failures
