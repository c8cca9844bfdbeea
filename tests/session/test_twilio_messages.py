"""Twilio inbound frames: recorded-style JSON parsed to typed messages, every malformed case refused with
the close code of the table in messages.py, and the per-socket rules of TwilioStreamGuard."""

from __future__ import annotations

import base64
import copy
import json
import logging
from typing import Any

import numpy as np
import pytest

from voice_server.audio import ulaw_decode
from voice_server.session.twilio import (
    TwilioConnected,
    TwilioDtmf,
    TwilioMark,
    TwilioMedia,
    TwilioMediaFormat,
    TwilioProtocolError,
    TwilioStart,
    TwilioStop,
    TwilioStreamGuard,
    parse_twilio_message,
)

STREAM = "MZ18ad3ab5a668481ce02b83e7395059f0"
ACCOUNT = "AC0123456789abcdef0123456789abcdef"
CALL = "CA0123456789abcdef0123456789abcdef"
PAYLOAD = bytes(i % 256 for i in range(0x70, 0x70 + 160))  # 20 ms of mu-law

# NOTE: shapes as Twilio sends them (docs' examples): counters are strings, sampleRate/channels numbers.
CONNECTED = {"event": "connected", "protocol": "Call", "version": "1.0.0"}
START = {
    "event": "start",
    "sequenceNumber": "1",
    "start": {
        "accountSid": ACCOUNT,
        "streamSid": STREAM,
        "callSid": CALL,
        "tracks": ["inbound"],
        "mediaFormat": {"encoding": "audio/x-mulaw", "sampleRate": 8000, "channels": 1},
        "customParameters": {"token": "s3cret", "caller": "+15550100"},
    },
    "streamSid": STREAM,
}


def media(seq: int, chunk: int, timestamp: int, payload: bytes = PAYLOAD, track: str = "inbound") -> dict[str, Any]:
    body = {"track": track, "chunk": str(chunk), "timestamp": str(timestamp), "payload": base64.b64encode(payload)}
    body["payload"] = body["payload"].decode()  # type: ignore[union-attr]
    return {"event": "media", "sequenceNumber": str(seq), "media": body, "streamSid": STREAM}


def mark(seq: int, name: str) -> dict[str, Any]:
    return {"event": "mark", "sequenceNumber": str(seq), "streamSid": STREAM, "mark": {"name": name}}


def dtmf(seq: int, digit: str) -> dict[str, Any]:
    return {"event": "dtmf", "streamSid": STREAM, "sequenceNumber": str(seq),
            "dtmf": {"track": "inbound_track", "digit": digit}}


def stop(seq: int) -> dict[str, Any]:
    return {"event": "stop", "sequenceNumber": str(seq), "streamSid": STREAM,
            "stop": {"accountSid": ACCOUNT, "callSid": CALL}}


def parse(msg: object) -> Any:
    return parse_twilio_message(json.dumps(msg))


def test_recorded_call_parses_to_typed_messages() -> None:
    assert parse(CONNECTED) == TwilioConnected("Call", "1.0.0")
    start = parse(START)
    assert isinstance(start, TwilioStart)
    assert (start.sequence_number, start.stream_sid, start.account_sid, start.call_sid) == (1, STREAM, ACCOUNT, CALL)
    assert start.tracks == ("inbound",) and start.media_format == TwilioMediaFormat("audio/x-mulaw", 8000, 1)
    assert dict(start.custom_parameters) == {"token": "s3cret", "caller": "+15550100"}
    with pytest.raises(TypeError):
        start.custom_parameters["token"] = "x"  # type: ignore[index]
    chunk = parse(media(2, 1, 0))
    assert chunk == TwilioMedia(2, STREAM, "inbound", 1, 0, PAYLOAD)
    assert chunk.num_samples == 160 and chunk.duration_ms == 20.0
    np.testing.assert_array_equal(chunk.pcm16(), ulaw_decode(np.frombuffer(PAYLOAD, dtype=np.uint8)))
    assert parse(dtmf(3, "#")) == TwilioDtmf(3, STREAM, "inbound_track", "#")
    assert parse(mark(4, "vs1")) == TwilioMark(4, STREAM, "vs1")
    assert parse(stop(5)) == TwilioStop(5, STREAM, ACCOUNT, CALL)


def test_integer_counters_extra_fields_and_missing_custom_parameters_are_accepted() -> None:
    msg = media(7, 3, 40)
    msg["sequenceNumber"], msg["media"]["chunk"], msg["extra"] = 7, 3, {"future": True}
    assert parse(msg) == TwilioMedia(7, STREAM, "inbound", 3, 40, PAYLOAD)
    start = copy.deepcopy(START)
    del start["start"]["customParameters"]  # type: ignore[attr-defined]
    parsed = parse(start)
    assert isinstance(parsed, TwilioStart) and dict(parsed.custom_parameters) == {}
    assert parse(media(2, 1, 0, payload=b"")).payload == b""


def _mutated(base: dict[str, Any], path: tuple[str, ...], value: object) -> dict[str, Any]:
    msg = copy.deepcopy(base)
    target = msg
    for key in path[:-1]:
        target = target[key]
    if value is _DELETE:
        del target[path[-1]]
    else:
        target[path[-1]] = value
    return msg


_DELETE = object()
MALFORMED = [
    ("missing event", CONNECTED, ("event",), _DELETE),
    ("event not a string", CONNECTED, ("event",), 3),
    ("connected without version", CONNECTED, ("version",), _DELETE),
    ("seq missing", START, ("sequenceNumber",), _DELETE),
    ("seq float", START, ("sequenceNumber",), 1.5),
    ("seq bool", START, ("sequenceNumber",), True),
    ("seq negative", START, ("sequenceNumber",), "-1"),
    ("seq hex", START, ("sequenceNumber",), "0x1"),
    ("seq spaces", START, ("sequenceNumber",), " 1"),
    ("seq empty", START, ("sequenceNumber",), ""),
    ("seq exponent", START, ("sequenceNumber",), "1e3"),
    ("seq arabic digits", START, ("sequenceNumber",), "\u0663"),
    ("seq 5000 digits", START, ("sequenceNumber",), "9" * 5000),
    ("streamSid missing", START, ("streamSid",), _DELETE),
    ("streamSid empty", START, ("streamSid",), ""),
    ("streamSid huge", START, ("streamSid",), "M" * 500),
    ("inner streamSid differs", START, ("start", "streamSid"), "MZother"),
    ("start body missing", START, ("start",), _DELETE),
    ("start body a list", START, ("start",), []),
    ("accountSid number", START, ("start", "accountSid"), 12),
    ("callSid missing", START, ("start", "callSid"), _DELETE),
    ("tracks a string", START, ("start", "tracks"), "inbound"),
    ("tracks empty", START, ("start", "tracks"), []),
    ("tracks unknown", START, ("start", "tracks"), ["inbound", "both"]),
    ("tracks repeated", START, ("start", "tracks"), ["inbound", "inbound"]),
    ("customParameters a list", START, ("start", "customParameters"), ["token"]),
    ("customParameters value not a string", START, ("start", "customParameters", "token"), 5),
    ("mediaFormat missing", START, ("start", "mediaFormat"), _DELETE),
    ("sampleRate a float", START, ("start", "mediaFormat", "sampleRate"), 8000.0),
    ("media body missing", media(2, 1, 0), ("media",), _DELETE),
    ("payload missing", media(2, 1, 0), ("media", "payload"), _DELETE),
    ("payload bad base64", media(2, 1, 0), ("media", "payload"), "!!!notbase64"),
    ("payload unpadded", media(2, 1, 0), ("media", "payload"), "AAA"),
    ("chunk zero", media(2, 1, 0), ("media", "chunk"), "0"),
    ("chunk not a number", media(2, 1, 0), ("media", "chunk"), "one"),
    ("timestamp not a number", media(2, 1, 0), ("media", "timestamp"), "12ms"),
    ("track unknown", media(2, 1, 0), ("media", "track"), "both"),
    ("mark name missing", mark(3, "a"), ("mark", "name"), _DELETE),
    ("mark name a number", mark(3, "a"), ("mark", "name"), 1),
    ("dtmf track missing", dtmf(3, "1"), ("dtmf", "track"), _DELETE),
    ("stop body missing", stop(3), ("stop",), _DELETE),
]


@pytest.mark.parametrize(("base", "path", "value"), [m[1:] for m in MALFORMED], ids=[m[0] for m in MALFORMED])
def test_malformed_known_events_close_with_1008(base: dict[str, Any], path: tuple[str, ...], value: object) -> None:
    error = parse(_mutated(base, path, value))
    assert isinstance(error, TwilioProtocolError), error
    assert error.close_code == 1008 and error.is_fatal and error.reason


@pytest.mark.parametrize(
    ("field", "value"), [("encoding", "audio/l16"), ("sampleRate", 16000), ("channels", 2), ("sampleRate", "16000")]
)
def test_unsupported_media_format_closes_with_1003(field: str, value: object) -> None:
    error = parse(_mutated(START, ("start", "mediaFormat", field), value))
    assert error == TwilioProtocolError(error.reason, 1003, "start") and "unsupported media format" in error.reason
    assert isinstance(parse(_mutated(START, ("start", "mediaFormat", "sampleRate"), "8000")), TwilioStart)


@pytest.mark.parametrize(
    ("frame", "close_code"),
    [
        (b'{"event":"connected"}', 1003),
        (bytearray(b"\x00\x01"), 1003),
        ("not json", 1008),
        ("", 1008),
        ("[1, 2]", 1008),
        ('"connected"', 1008),
        ("null", 1008),
        ("[" * 100_000 + "]" * 100_000, 1009),
        ("[" * 30_000 + "]" * 30_000, 1008),
        ('{"event": "media", ' + '"x": "' + "a" * 70_000 + '"}', 1009),
    ],
    ids=["bytes", "bytearray", "garbage", "empty", "array", "string", "null", "huge", "deep", "oversized"],
)
def test_frames_that_are_not_twilio_json_close(frame: str | bytes, close_code: int) -> None:
    error = parse_twilio_message(frame)
    assert isinstance(error, TwilioProtocolError) and error.close_code == close_code


def test_unknown_event_and_bad_dtmf_digit_are_ignored() -> None:
    assert parse({"event": "transcription", "streamSid": STREAM}) == TwilioProtocolError(
        "unknown event 'transcription'", None, "transcription"
    )
    error = parse(dtmf(3, "x"))
    assert isinstance(error, TwilioProtocolError) and error.close_code is None and not error.is_fatal


def test_message_types_validate_on_construction() -> None:
    with pytest.raises(ValueError, match="chunk must be an integer >= 1"):
        TwilioMedia(1, STREAM, "inbound", 0, 0, b"")
    with pytest.raises(ValueError, match="media format must be"):
        TwilioMediaFormat("audio/x-mulaw", 16000, 1)
    with pytest.raises(ValueError, match="stream_sid"):
        TwilioStop(1, "", ACCOUNT, CALL)
    with pytest.raises(ValueError, match="close_code"):
        TwilioProtocolError("x", 1000)


def _guard_after_start() -> TwilioStreamGuard:
    guard = TwilioStreamGuard()
    assert isinstance(guard.receive(json.dumps(CONNECTED)), TwilioConnected)
    assert isinstance(guard.receive(json.dumps(START)), TwilioStart)
    return guard


def test_guard_accepts_a_recorded_call_in_order() -> None:
    guard = _guard_after_start()
    assert guard.stream_sid == STREAM and guard.start is not None and guard.start.call_sid == CALL
    frames = [media(2, 1, 0), media(3, 2, 20), mark(4, "vs1"), dtmf(5, "7"), media(6, 3, 40), stop(7)]
    results = [guard.receive(json.dumps(f)) for f in frames]
    assert not any(isinstance(r, TwilioProtocolError) for r in results)
    assert guard.latest_media_timestamp_ms == 40 and guard.is_stopped and guard.num_ignored == 0


def test_guard_start_without_connected_is_accepted() -> None:
    guard = TwilioStreamGuard()
    assert isinstance(guard.receive(json.dumps(START)), TwilioStart)


@pytest.mark.parametrize("frame", [media(2, 1, 0), mark(2, "vs1"), dtmf(2, "1"), stop(2)], ids=lambda f: f["event"])
def test_guard_closes_on_anything_but_connected_before_start(frame: dict[str, Any]) -> None:
    guard = TwilioStreamGuard()
    error = guard.receive(json.dumps(frame))
    assert isinstance(error, TwilioProtocolError) and error.close_code == 1008 and "before start" in error.reason


def test_guard_closes_on_second_start_foreign_stream_and_outbound_only_start() -> None:
    guard = _guard_after_start()
    second = _mutated(START, ("sequenceNumber",), "9")
    assert guard.receive(json.dumps(second)) == TwilioProtocolError("a second start on one socket", 1008, "start")
    foreign = _mutated(media(2, 1, 0), ("streamSid",), "MZother")
    error = guard.receive(json.dumps(foreign))
    assert isinstance(error, TwilioProtocolError) and error.close_code == 1008 and "streamSid" in error.reason
    outbound_only = _mutated(START, ("start", "tracks"), ["outbound"])
    error = TwilioStreamGuard().receive(json.dumps(outbound_only))
    assert isinstance(error, TwilioProtocolError) and error.close_code == 1003


def test_guard_ignores_replays_outbound_media_repeated_connected_and_frames_after_stop(
    caplog: pytest.LogCaptureFixture,
) -> None:
    guard = _guard_after_start()
    caplog.set_level(logging.INFO, logger="voice_server.session.twilio")
    assert isinstance(guard.receive(json.dumps(media(2, 1, 0))), TwilioMedia)
    ignored = [
        media(2, 1, 0),  # replay of the same sequenceNumber
        media(1, 1, 0),  # older than the start
        media(3, 2, 20, track="outbound"),
        CONNECTED,
    ]
    for frame in ignored:
        error = guard.receive(json.dumps(frame))
        assert isinstance(error, TwilioProtocolError) and error.close_code is None, frame
    assert isinstance(guard.receive(json.dumps(media(4, 3, 40))), TwilioMedia)  # seq 3 was consumed
    assert isinstance(guard.receive(json.dumps(stop(5))), TwilioStop)
    for frame in (media(6, 4, 60), mark(7, "vs1"), stop(8)):
        error = guard.receive(json.dumps(frame))
        assert isinstance(error, TwilioProtocolError) and error.close_code is None and "after stop" in error.reason
    assert guard.num_ignored == 7
    assert sum("ignored a frame" in r.getMessage() for r in caplog.records) == 7


def test_guard_logs_fatal_errors_at_warning(caplog: pytest.LogCaptureFixture) -> None:
    guard = _guard_after_start()
    caplog.set_level(logging.INFO, logger="voice_server.session.twilio")
    error = guard.receive(b"\x00")
    assert isinstance(error, TwilioProtocolError) and error.close_code == 1003
    (record,) = caplog.records
    assert record.levelno == logging.WARNING and STREAM in record.getMessage() and "1003" in record.getMessage()


def test_guard_media_clock_never_runs_backwards() -> None:
    guard = _guard_after_start()
    for seq, timestamp in ((2, 100), (3, 60), (4, 120)):
        assert isinstance(guard.receive(json.dumps(media(seq, seq - 1, timestamp))), TwilioMedia)
        assert guard.latest_media_timestamp_ms == max(100, timestamp)
