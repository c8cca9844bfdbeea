"""`WS /ws` end to end: a real uvicorn server on 127.0.0.1 (`session_server`: in this process, on the
coordinator's loop, so the test can read the stages' counters), real stage processes running a stand-in
speech stage (`tests/speech_stages.py`), and real WebSocket clients streaming speech-like audio at real-time
pace: turn detection, responses with audio, history across turns, barge-in, cancellation, bad input,
and a client that vanishes mid-response."""

from __future__ import annotations

import json
import time
from typing import Any

import pytest
from live_server import (
    RATE,
    events_until,
    stream_audio,
)
from live_server import open_session as live_open_session
from session_server import SessionServer, check_vanished_client_aborted
from speech_signals import signal_of
from websockets.exceptions import ConnectionClosed
from websockets.sync.client import ClientConnection, connect


def open_session(server: SessionServer, **start: Any) -> ClientConnection:
    return live_open_session(f"ws://127.0.0.1:{server.port}/ws", **start)


def test_a_spoken_turn_gets_a_spoken_reply_and_the_next_turn_sees_it(server: SessionServer) -> None:
    ws = open_session(server)
    stream_audio(ws, signal_of(RATE, ("noise", 300), ("voice", 900), ("noise", 700)), pace=4.0)
    events, audio = events_until(ws, "response_done")
    kinds = [e["type"] for e in events]
    assert kinds[:4] == ["speech_started", "speech_stopped", "input_committed", "response_started"], kinds
    committed = events[2]
    assert 800 <= committed["audio_ms"] <= 2000  # the turn: prefix padding, speech and closing silence
    done = events[-1]
    assert done["status"] == "completed" and done["text"].split()[:2] == ["m1a1", "p0"]
    assert audio == 12 * 80 * 24 * 2, "12 words x 80 ms at 24 kHz, 16-bit"
    assert done["audio_ms"] == 12 * 80 and "speech" in done["timings_ms"] and "first_audio_sent" in done["timings_ms"]
    assert "".join(e["delta"] for e in events if e["type"] == "text_delta") == " " + done["text"].strip()
    # A typed second turn sees the spoken one and the reply: system-less, so 3 messages, 1 with audio.
    ws.send(json.dumps({"type": "text", "text": "and now?"}))
    events, _ = events_until(ws, "response_done")
    assert events[-1]["text"].split()[:2] == ["m3a1", "p12"]
    ws.close()


def test_barge_in_stops_the_audio_and_keeps_only_what_was_played(server: SessionServer) -> None:
    ws = open_session(server, params={"sampling": {"max_tokens": 200}})
    ws.send(json.dumps({"type": "text", "text": "tell me a long story"}))
    events, audio = events_until(ws, "response_started")
    deadline = time.monotonic() + 5
    while audio < 24 * 2 * 400:  # at least 400 ms of reply audio has arrived
        message = ws.recv(max(0.01, deadline - time.monotonic()))
        audio += len(message) if isinstance(message, bytes) else 0
    ws.send(json.dumps({"type": "playback", "played_ms": 240}))
    stream_audio(ws, signal_of(RATE, ("voice", 600), ("noise", 700)), pace=1.0)
    events, late_audio = events_until(ws, "response_done")
    kinds = [e["type"] for e in events]
    assert "speech_started" in kinds and kinds.index("speech_started") < kinds.index("response_done")
    started = events[kinds.index("speech_started")]
    # NOTE: audio stops at once: after the client sees speech_started, at most the one 80 ms chunk
    # already being written arrives, and the response is done within 100 ms.
    assert late_audio - started["audio_before"] <= 80 * 24 * 2, (late_audio, started["audio_before"])
    assert events[-1]["at"] - started["at"] < 0.1
    truncated = next(e for e in events if e["type"] == "item_truncated")
    assert truncated["audio_end_ms"] == 240
    done = events[-1]
    assert done["status"] == "cancelled" and done["audio_ms"] == 240
    # The text is cut in proportion to the audio heard, at a word boundary: 240 ms of 80 ms words is
    # about 3 words (word lengths differ, so 2-3); the next request's history holds exactly that text.
    assert 2 <= len(done["text"].split()) <= 3, done["text"]
    events, _ = events_until(ws, "response_done")  # the interruption's own turn gets a reply
    assert events[-1]["text"].split()[:2] == ["m3a1", f"p{len(done['text'].split())}"]
    ws.close()


def test_cancel_and_bad_messages_get_events_and_the_session_goes_on(server: SessionServer) -> None:
    ws = open_session(server, turn_detection=None)
    for bad, code in (("{not json", "invalid_json"), (json.dumps({"type": "dance"}), "unknown_event"),
                      (json.dumps({"type": "playback", "played_ms": -3}), "invalid_value"),
                      (json.dumps({"type": "response.cancel"}), "no_response")):
        ws.send(bad)
        event = json.loads(ws.recv(5))
        assert event["type"] == "error" and event["code"] == code, event
    ws.send(b"\x01\x02\x03")
    assert json.loads(ws.recv(5))["code"] == "invalid_audio"
    ws.send(json.dumps({"type": "text", "text": "hi"}))
    events_until(ws, "response_started")
    ws.send(json.dumps({"type": "response.cancel"}))
    events, _ = events_until(ws, "response_done")
    assert events[-1]["status"] == "cancelled"
    ws.send(json.dumps({"type": "text", "text": "again"}))
    events, _ = events_until(ws, "response_done")
    assert events[-1]["status"] == "completed"
    ws.close()


@pytest.mark.parametrize("first", ["hello", json.dumps({"type": "session.start", "input_rate": 11025}),
                                   json.dumps({"type": "session.start", "turn_detection": {"threshold": 5}})])
def test_a_bad_first_message_closes_with_1008(server: SessionServer, first: str) -> None:
    ws = connect(f"ws://127.0.0.1:{server.port}/ws", open_timeout=5)
    ws.send(first)
    with pytest.raises(ConnectionClosed) as info:
        ws.recv(5)
    assert info.value.rcvd is not None and info.value.rcvd.code == 1008


def test_an_oversize_frame_closes_with_1009(server: SessionServer) -> None:
    ws = open_session(server)
    ws.send(b"\x00" * (2 << 20))
    with pytest.raises(ConnectionClosed) as info:
        ws.recv(5)
    assert info.value.rcvd is not None and info.value.rcvd.code == 1009


def test_a_client_that_vanishes_mid_response_frees_the_stage(server: SessionServer) -> None:
    before = server.metrics()
    ws = open_session(server, params={"sampling": {"max_tokens": 400}})  # NOTE: a reply of 12 s
    ws.send(json.dumps({"type": "text", "text": "go on forever"}))
    events_until(ws, "response_started")
    ws.recv(5)
    ws.socket.close()  # NOTE: no close frame: the TCP connection just ends
    check_vanished_client_aborted(server, before)


def test_speaking_over_a_reply_that_is_still_playing_keeps_only_what_was_played(server: SessionServer) -> None:
    # NOTE: generation runs faster than real time: the reply is complete at the server while the
    # client is still playing it; the playback report says how much was heard when the user speaks.
    ws = open_session(server)
    ws.send(json.dumps({"type": "text", "text": "a short answer please"}))
    events, _ = events_until(ws, "response_done")
    reply = events[-1]
    assert reply["status"] == "completed" and reply["audio_ms"] == 12 * 80
    ws.send(json.dumps({"type": "playback", "played_ms": 320}))
    stream_audio(ws, signal_of(RATE, ("voice", 600), ("noise", 700)), pace=1.0)
    events, _ = events_until(ws, "response_done")
    truncated = [e for e in events if e["type"] == "item_truncated"]
    assert [(e["item_id"], e["audio_end_ms"]) for e in truncated] == [(reply["item_id"], 320)]
    # 320 ms of 80 ms words: about 4 words (lengths differ: 3-4) kept for the next turn.
    assert events[-1]["text"].split()[0] == "m3a1" and events[-1]["text"].split()[1] in ("p3", "p4")
    ws.close()
