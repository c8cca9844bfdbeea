"""`WS /v1/realtime` end to end with a raw WebSocket client (`realtime_client`): a real uvicorn server
over real stage processes running the stand-in speech stage (`session_server`), speech-like audio
appended as base64 at real-time pace (or faster, under the 2x limit), every server event checked against
the `openai` SDK's models. Spoken turns and history, barge-in and truncation, G.711, manual turns,
every class of malformed input, and a client that vanishes mid-response."""

from __future__ import annotations

import json

import numpy as np
from realtime_client import RealtimeClient, audio_bytes, encode, text_item, transcript, without_deltas
from session_server import SessionServer, check_vanished_client_aborted
from speech_signals import signal_of

from voice_server.audio import b64decode, b64encode, ulaw_decode
from voice_server.session.conversation import cut_text

RATE = 24000
PCM_BYTES_PER_MS = RATE // 1000 * 2
WORD_MS = 80  # the stand-in stage speaks one word and 80 ms of tone per step
RESPONSE_EVENTS = ["response.created", "response.output_item.added", "conversation.item.added",
                   "response.content_part.added"]
AUDIO_DONE_EVENTS = ["response.output_audio.done", "response.output_audio_transcript.done",
                     "response.content_part.done", "response.output_item.done", "conversation.item.done",
                     "response.done"]
USER_TURN_EVENTS = ["input_audio_buffer.committed", "conversation.item.added", "conversation.item.done"]


def speech(rate: int = RATE) -> np.ndarray:
    return signal_of(rate, ("noise", 300), ("voice", 900), ("noise", 700))


def test_a_spoken_turn_gets_a_spoken_reply_and_the_next_turn_sees_it(server: SessionServer) -> None:
    client = RealtimeClient(server.port)
    assert client.session["audio"]["input"]["format"] == {"type": "audio/pcm", "rate": 24000}
    assert client.session["audio"]["input"]["turn_detection"]["type"] == "server_vad"
    client.update(max_output_tokens=12)
    client.stream(encode(speech()), PCM_BYTES_PER_MS, pace=1.8)
    events = client.until("response.done")
    assert without_deltas(events) == ["input_audio_buffer.speech_started", "input_audio_buffer.speech_stopped",
                                      *USER_TURN_EVENTS, *RESPONSE_EVENTS, *AUDIO_DONE_EVENTS]
    started, stopped, committed, added = events[:4]
    user_id = started["item_id"]
    assert stopped["item_id"] == committed["item_id"] == added["item"]["id"] == user_id
    assert committed["previous_item_id"] is None and added["item"]["content"] == [
        {"type": "input_audio", "transcript": None}]
    assert 0 <= started["audio_start_ms"] < 600 < stopped["audio_end_ms"] <= 1900
    assert audio_bytes(events) == 12 * WORD_MS * PCM_BYTES_PER_MS
    done = events[-1]["response"]
    spoken = done["output"][0]["content"][0]
    assert done["status"] == "completed" and done["status_details"] == {"type": "completed"}
    assert spoken == {"type": "output_audio", "transcript": transcript(events)}
    assert spoken["transcript"].split()[:2] == ["m1a1", "p0"]
    assert done["usage"]["output_tokens"] == 12 and done["usage"]["input_tokens"] > 0
    timings = done["x_voice_server"]["timings_ms"]
    assert "speech" in timings and "first_audio_sent" in timings
    reply_added = events[without_deltas(events).index("conversation.item.added", 5)]
    assert reply_added["previous_item_id"] == user_id
    # A typed second turn sees the spoken one and the reply: 3 messages, 1 with audio, 12 words before.
    client.send("conversation.item.create", item=text_item("and now?"))
    events = client.until("conversation.item.done")
    assert events[-1]["item"]["content"] == [{"type": "input_text", "text": "and now?"}]
    client.send("response.create")
    events = client.until("response.done")
    assert transcript(events).split()[:2] == ["m3a1", "p12"]
    client.close()


def test_barge_in_stops_the_audio_and_a_truncate_keeps_only_what_was_heard(server: SessionServer) -> None:
    client = RealtimeClient(server.port)
    client.update(max_output_tokens=200)
    client.send("conversation.item.create", item=text_item("tell me a long story"))
    client.send("response.create")
    events = client.until("response.content_part.added")
    reply_id = events[-1]["item_id"]
    while audio_bytes(events) < 400 * PCM_BYTES_PER_MS:  # at least 400 ms of the reply has arrived
        events.append(client.next())
    client.stream(encode(signal_of(RATE, ("voice", 600))), PCM_BYTES_PER_MS)
    events = client.until("response.done")
    kinds = [e["type"] for e in events]
    started_at = kinds.index("input_audio_buffer.speech_started")
    started = events[started_at]
    # NOTE: audio stops at once: after speech_started, at most the one 80 ms chunk already being
    # written arrives, and the response is done within 100 ms, as the client sees it.
    assert audio_bytes(events[started_at:]) <= WORD_MS * PCM_BYTES_PER_MS
    assert events[-1]["_at"] - started["_at"] < 0.1
    done = events[-1]["response"]
    assert done["status"] == "cancelled"
    assert done["status_details"] == {"type": "cancelled", "reason": "turn_detected"}
    assert done["output"][0]["status"] == "incomplete"
    # The server cut nothing yet (no playback report in this protocol: all it sent counts as heard).
    sent_ms = next(e for e in events if e["type"] == "conversation.item.truncated")["audio_end_ms"]
    said = done["output"][0]["content"][0]["transcript"]
    assert sent_ms >= 400 and len(said.split()) == sent_ms // WORD_MS
    client.send("conversation.item.truncate", item_id=reply_id, content_index=0, audio_end_ms=240)
    truncated = client.until("conversation.item.truncated")[-1]
    assert (truncated["item_id"], truncated["audio_end_ms"]) == (reply_id, 240)
    # NOTE: a short answer: the server paces audio at real time, so a 200-word one would take 16 s.
    client.update(max_output_tokens=12)
    client.stream(encode(signal_of(RATE, ("noise", 700))), PCM_BYTES_PER_MS)
    events = client.until("response.done")  # the interruption's own turn gets a reply
    heard = cut_text(said, 240 / sent_ms)
    assert 2 <= len(heard.split()) <= 3
    assert transcript(events).split()[:2] == ["m3a1", f"p{len(heard.split())}"]
    client.close()


def test_g711_in_and_out(server: SessionServer) -> None:
    client = RealtimeClient(server.port)
    session = client.update(max_output_tokens=12, audio={"input": {"format": {"type": "audio/pcmu"}},
                                                         "output": {"format": {"type": "audio/pcmu"}}})
    assert session["audio"]["input"]["format"] == session["audio"]["output"]["format"] == {"type": "audio/pcmu"}
    client.stream(encode(speech(8000), "audio/pcmu"), 8, pace=1.8)
    events = client.until("response.done")
    assert without_deltas(events)[:2] == ["input_audio_buffer.speech_started", "input_audio_buffer.speech_stopped"]
    # NOTE: one byte per sample at 8 kHz; resampling 24 -> 8 kHz adds its filter's flushed tail (a few ms).
    assert 0 <= audio_bytes(events) - 12 * WORD_MS * 8 <= 8 * 10
    delta = next(e for e in events if e["type"] == "response.output_audio.delta")
    tone = ulaw_decode(np.frombuffer(b64decode(delta["delta"]), dtype=np.uint8))
    assert 5000 < np.abs(tone).max() < 8000, "the stand-in's tone is at 0.2 of full scale"
    assert events[-1]["response"]["status"] == "completed"
    client.close()


def test_manual_turns_append_commit_and_respond(server: SessionServer) -> None:
    client = RealtimeClient(server.port)
    session = client.update(max_output_tokens=12, audio={"input": {"turn_detection": None}})
    assert session["audio"]["input"]["turn_detection"] is None
    client.stream(encode(speech()), PCM_BYTES_PER_MS, pace=1.8)
    client.send("input_audio_buffer.commit", event_id="evt_commit")
    events = client.until("conversation.item.done")
    assert without_deltas(events) == USER_TURN_EVENTS, "no turn detection, so no speech events"
    client.send("response.create")
    events = client.until("response.done")
    assert without_deltas(events) == [*RESPONSE_EVENTS, *AUDIO_DONE_EVENTS]
    assert transcript(events).split()[:2] == ["m1a1", "p0"]
    client.send("input_audio_buffer.append", audio=b64encode(encode(signal_of(RATE, ("voice", 200)))))
    client.send("input_audio_buffer.clear")
    client.until("input_audio_buffer.cleared")
    client.send("input_audio_buffer.commit")
    assert client.until("error")[-1]["error"]["code"] == "input_audio_buffer_commit_empty"
    client.close()


def _bad(event_type: str, **fields: object) -> str:
    return json.dumps({"type": event_type, "event_id": "evt_bad", **fields})


MALFORMED: list[tuple[str | bytes, str, str | None]] = [
    ("{not json", "invalid_json", None),
    (json.dumps([1, 2]), "invalid_event", None),
    (json.dumps({"type": "dance"}), "invalid_value", "type"),
    (_bad("input_audio_buffer.append", audio=5), "invalid_type", "audio"),
    (_bad("input_audio_buffer.append", audio="not base64!"), "invalid_base64", "audio"),
    (_bad("input_audio_buffer.append", audio=b64encode(b"\x01\x02\x03")), "invalid_value", "audio"),
    (_bad("conversation.item.truncate", item_id="item_x", content_index="0", audio_end_ms=5), "invalid_type",
     "content_index"),
    (_bad("session.update", session={"audio": {"input": {"format": {"type": "audio/wav"}}}}), "invalid_value",
     "session.audio.input.format.type"),
    (_bad("session.update", session={"audio": {"output": {"format": {"type": "audio/pcm", "rate": 16000}}}}),
     "invalid_value", "session.audio.output.format.rate"),
    (_bad("session.update", session={"audio": {"input": {"turn_detection": {"type": "server_vad",
                                                                             "prefix_padding_ms": 8000}}}}),
     "invalid_value", "session.audio.input.turn_detection"),
    (b"\x00\x01\x02\x03", "binary_frame", None),
    (_bad("input_audio_buffer.commit"), "input_audio_buffer_commit_empty", None),
    (_bad("conversation.item.truncate", item_id="item_x", content_index=0, audio_end_ms=5), "invalid_value",
     "item_id"),
    (_bad("conversation.item.delete", item_id="item_x"), "invalid_value", "item_id"),
    (_bad("conversation.item.create", item=text_item("hi"), previous_item_id="item_x"), "invalid_value",
     "previous_item_id"),
    (_bad("response.cancel"), "response_cancel_not_active", "response_id"),
    (_bad("input_audio_buffer.append", audio=b64encode(b"\x00" * 5 * RATE * 2)), "input_audio_too_fast", "audio"),
]


def test_malformed_input_gets_error_events_while_another_session_keeps_working(server: SessionServer) -> None:
    other = RealtimeClient(server.port)
    other.update(max_output_tokens=60)
    other.send("conversation.item.create", item=text_item("talk while the other fails"))
    other.send("response.create")
    client = RealtimeClient(server.port)
    for frame, code, param in MALFORMED:
        client.ws.send(frame)
        error = client.until("error")[-1]["error"]
        assert (error["code"], error["param"]) == (code, param), (frame[:80], error)
        assert error["event_id"] == ("evt_bad" if isinstance(frame, str) and "evt_bad" in frame else None)
    # The session goes on: a response, then events that are wrong only for the state it is in.
    client.update(max_output_tokens=30)
    client.send("conversation.item.create", item=text_item("still there?"))
    client.send("response.create")
    reply_id = client.until("response.content_part.added")[-1]["item_id"]
    client.send("response.create")
    assert client.until("error")[-1]["error"]["code"] == "conversation_already_has_active_response"
    assert client.until("response.done")[-1]["response"]["status"] == "completed"
    client.send("conversation.item.truncate", item_id=reply_id, content_index=0, audio_end_ms=30 * WORD_MS + 1)
    assert client.until("error")[-1]["error"]["param"] == "audio_end_ms"
    client.send("conversation.item.delete", item_id=reply_id)
    assert client.until("conversation.item.deleted")[-1]["item_id"] == reply_id
    events = other.until("response.done")
    assert events[-1]["response"]["status"] == "completed" and audio_bytes(events) == 60 * WORD_MS * PCM_BYTES_PER_MS
    client.close()
    other.close()


def test_cancel_text_output_and_browser_subprotocols(server: SessionServer) -> None:
    client = RealtimeClient(server.port, subprotocols=["realtime", "openai-insecure-api-key.sk-x",
                                                       "openai-beta.realtime-v1"])
    assert client.ws.subprotocol == "realtime"
    client.update(max_output_tokens=200, output_modalities=["text"])
    client.send("conversation.item.create", item=text_item("write, do not speak"))
    client.send("response.create")
    rid = client.until("response.output_text.delta")[-1]["response_id"]
    client.send("response.cancel", response_id=rid)
    events = client.until("response.done")
    assert audio_bytes(events) == 0
    assert without_deltas(events)[-5:] == ["response.output_text.done", "response.content_part.done",
                                           "response.output_item.done", "conversation.item.done", "response.done"]
    assert events[-1]["response"]["status_details"] == {"type": "cancelled", "reason": "client_cancelled"}
    assert events[-1]["response"]["output_modalities"] == ["text"]
    client.close()


def test_a_client_that_vanishes_mid_response_frees_the_stage(server: SessionServer) -> None:
    before = server.metrics()
    client = RealtimeClient(server.port)
    client.update(max_output_tokens=400)  # NOTE: a reply of 12 s
    client.send("conversation.item.create", item=text_item("go on forever"))
    client.send("response.create")
    client.until("response.output_audio.delta")
    client.ws.socket.close()  # NOTE: no close frame: the TCP connection just ends
    check_vanished_client_aborted(server, before)
