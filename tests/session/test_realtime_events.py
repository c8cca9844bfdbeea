"""Realtime client events: every event parsed from realistic GA and beta JSON, every malformed one answered
with the right error code, param and event_id (never an exception)."""

from __future__ import annotations

import base64
import json
from typing import Any

import pytest

from voice_server.session.realtime import (
    DEFAULT_SESSION,
    ERROR_CODES,
    MAX_AUDIO_BYTES,
    MAX_EVENT_CHARS,
    AudioFormat,
    ConversationItemCreate,
    ConversationItemDelete,
    ConversationItemTruncate,
    InputAudioBufferAppend,
    InputAudioBufferClear,
    InputAudioBufferCommit,
    MessageItem,
    ProtocolError,
    ResponseCancel,
    ResponseCreate,
    ResponseOverrides,
    SessionUpdate,
    parse_client_event,
)


def _parse(event: dict[str, Any]) -> Any:
    return parse_client_event(json.dumps(event))


def test_append_decodes_audio_and_keeps_event_id() -> None:
    pcm = bytes(range(256)) * 10
    event = _parse({"type": "input_audio_buffer.append", "event_id": "evt_1", "audio": base64.b64encode(pcm).decode()})
    assert event == InputAudioBufferAppend(pcm, "evt_1")


@pytest.mark.parametrize(("event", "expected"), [
    ({"type": "input_audio_buffer.commit"}, InputAudioBufferCommit()),
    ({"type": "input_audio_buffer.clear", "event_id": "c1"}, InputAudioBufferClear("c1")),
    ({"type": "conversation.item.truncate", "event_id": "t", "item_id": "item_1", "content_index": 0,
      "audio_end_ms": 1500}, ConversationItemTruncate("item_1", 0, 1500, "t")),
    # NOTE: JS clients serialise whole numbers as floats sometimes; 1500.0 is an integer in JSON terms.
    ({"type": "conversation.item.truncate", "item_id": "item_1", "content_index": 0, "audio_end_ms": 1500.0},
     ConversationItemTruncate("item_1", 0, 1500)),
    ({"type": "conversation.item.delete", "item_id": "item_9"}, ConversationItemDelete("item_9")),
    ({"type": "response.cancel"}, ResponseCancel()),
    ({"type": "response.cancel", "response_id": "resp_1", "event_id": "x"}, ResponseCancel("resp_1", "x")),
    ({"type": "response.create"}, ResponseCreate()),
    ({"type": "response.create", "response": None}, ResponseCreate()),
])
def test_simple_events(event: dict[str, Any], expected: object) -> None:
    assert _parse(event) == expected


@pytest.mark.parametrize(("role", "part_type"), [("user", "input_text"), ("system", "input_text"),
                                                 ("assistant", "output_text"), ("assistant", "text")])
def test_item_create_text_messages(role: str, part_type: str) -> None:
    event = _parse({"type": "conversation.item.create", "event_id": "e", "previous_item_id": "root", "item": {
        "id": "msg_1", "type": "message", "role": role, "object": "realtime.item", "status": "completed",
        "content": [{"type": part_type, "text": "Hello, "}, {"type": part_type, "text": "world"}]}})
    assert event == ConversationItemCreate(MessageItem(role, ("Hello, ", "world"), "msg_1"), "root", "e")  # type: ignore[arg-type]
    assert event.item.text == "Hello, world"


def test_response_create_ga_overrides() -> None:
    event = _parse({"type": "response.create", "event_id": "r", "response": {
        "instructions": "Be brief.", "output_modalities": ["text"], "conversation": "none",
        "metadata": {"topic": "greeting"}, "max_output_tokens": 200, "tool_choice": "auto", "tools": [],
        "audio": {"output": {"voice": "marin", "format": {"type": "audio/pcmu"}}}}})
    assert event == ResponseCreate(ResponseOverrides(
        instructions="Be brief.", output_modalities=("text",), voice="marin", output_format=AudioFormat("audio/pcmu"),
        max_output_tokens=200, metadata={"topic": "greeting"}, tools=(), tool_choice="auto", is_out_of_band=True), "r")


def test_response_create_beta_overrides() -> None:
    event = _parse({"type": "response.create", "response": {
        "modalities": ["audio", "text"], "voice": "alloy", "output_audio_format": "g711_alaw", "temperature": 0.8,
        "max_response_output_tokens": "inf", "conversation": "auto"}})
    assert event == ResponseCreate(ResponseOverrides(
        output_modalities=("audio",), voice="alloy", output_format=AudioFormat("audio/pcma"), temperature=0.8,
        max_output_tokens="inf"))


def test_session_update_ga_and_beta_give_the_same_session() -> None:
    ga = _parse({"type": "session.update", "event_id": "s1", "session": {
        "type": "realtime", "output_modalities": ["audio"], "instructions": "You are terse.",
        "audio": {"input": {"format": {"type": "audio/pcmu"},
                            "turn_detection": {"type": "server_vad", "threshold": 0.6, "silence_duration_ms": 700}},
                  "output": {"format": {"type": "audio/pcmu"}, "voice": "verse"}}}})
    beta = _parse({"type": "session.update", "session": {
        "modalities": ["text", "audio"], "instructions": "You are terse.", "input_audio_format": "g711_ulaw",
        "output_audio_format": "g711_ulaw", "voice": "verse",
        "turn_detection": {"type": "server_vad", "threshold": 0.6, "silence_duration_ms": 700}}})
    assert isinstance(ga, SessionUpdate) and isinstance(beta, SessionUpdate)
    assert ga.event_id == "s1"
    assert DEFAULT_SESSION.updated(ga.patch) == DEFAULT_SESSION.updated(beta.patch)
    session = DEFAULT_SESSION.updated(ga.patch)
    assert session.input_format.rate_hz == 8000 and session.output_format.is_g711
    assert session.turn_detection is not None and session.turn_detection.silence_duration_ms == 700


AUDIO_OK = base64.b64encode(b"\0\0").decode()

# (event, code, param, client event_id echoed)
BAD_EVENTS: list[tuple[str | bytes, str, str | None, str | None]] = [
    ("{not json", "invalid_json", None, None),
    (b'{"type": "input_audio_buffer.commit"}', "binary_frame", None, None),
    ('[{"type": "input_audio_buffer.commit"}]', "invalid_event", None, None),
    ('"input_audio_buffer.commit"', "invalid_event", None, None),
    ('{"event_id": "e1"}', "missing_required_parameter", "type", "e1"),
    ('{"type": 7, "event_id": "e1"}', "invalid_type", "type", "e1"),
    ('{"type": "input_audio_buffer.commit", "event_id": 5}', "invalid_type", "event_id", None),
    ('{"type": "response.audio.delta", "event_id": "e2"}', "invalid_value", "type", "e2"),
    ('{"type": "conversation.item.retrieve", "item_id": "i", "event_id": "e3"}', "unsupported", "type", "e3"),
    ('{"type": "output_audio_buffer.clear"}', "unsupported", "type", None),
    ('{"type": "input_audio_buffer.commit", "extra": 1}', "unknown_parameter", "extra", None),
    ('{"type": "input_audio_buffer.append", "event_id": "a"}', "missing_required_parameter", "audio", "a"),
    ('{"type": "input_audio_buffer.append", "audio": 12}', "invalid_type", "audio", None),
    ('{"type": "input_audio_buffer.append", "audio": "AA A=", "event_id": "a"}', "invalid_base64", "audio", "a"),
    ('{"type": "input_audio_buffer.append", "audio": "AAA"}', "invalid_base64", "audio", None),
    ('{"type": "conversation.item.truncate", "item_id": "i", "content_index": 0}', "missing_required_parameter",
     "audio_end_ms", None),
    ('{"type": "conversation.item.truncate", "item_id": "i", "content_index": 0, "audio_end_ms": -1}',
     "invalid_value", "audio_end_ms", None),
    ('{"type": "conversation.item.truncate", "item_id": "i", "content_index": 0, "audio_end_ms": 1.5}',
     "invalid_type", "audio_end_ms", None),
    ('{"type": "conversation.item.truncate", "item_id": "i", "content_index": true, "audio_end_ms": 1}',
     "invalid_type", "content_index", None),
    ('{"type": "conversation.item.delete", "item_id": ""}', "invalid_value", "item_id", None),
    ('{"type": "conversation.item.delete", "item_id": null}', "invalid_type", "item_id", None),
    ('{"type": "response.cancel", "response_id": 3}', "invalid_type", "response_id", None),
    ('{"type": "conversation.item.create", "item": {"type": "function_call", "name": "f"}}',
     "missing_required_parameter", "item.call_id", None),
    ('{"type": "conversation.item.create", "item": {"type": "function_call", "name": "f", "call_id": "c", '
     '"arguments": "[1]"}}', "invalid_value", "item.arguments", None),
    ('{"type": "conversation.item.create", "item": {"type": "mcp_call"}}', "unsupported", "item.type", None),
    ('{"type": "conversation.item.create", "item": {"type": "message", "role": "tool", "content": []}}',
     "invalid_value", "item.role", None),
    ('{"type": "conversation.item.create", "item": {"type": "message", "role": "user", "content": []}}',
     "invalid_value", "item.content", None),
    ('{"type": "conversation.item.create", "item": {"type": "message", "role": "user", "content": '
     '[{"type": "input_image", "image_url": "data:image/png;base64,AAAA"}]}}', "invalid_value",
     "item.content[0].image_url", None),
    ('{"type": "conversation.item.create", "item": {"type": "message", "role": "user", "content": '
     '[{"type": "input_image", "image_url": "data:image/png;base64,AAAA", "detail": "max"}]}}', "invalid_value",
     "item.content[0].detail", None),
    ('{"type": "conversation.item.create", "item": {"type": "message", "role": "assistant", "content": '
     '[{"type": "input_audio", "audio": "AAAA"}]}}', "invalid_value", "item.content[0].type", None),
    ('{"type": "conversation.item.create", "item": {"type": "message", "role": "user", "content": '
     '[{"type": "input_audio", "audio": "AAAA", "format": "wav"}]}}', "unknown_parameter",
     "item.content[0].format", None),
    ('{"type": "conversation.item.create", "item": {"type": "message", "role": "user", "content": '
     '[{"type": "input_audio", "audio": "AAA"}]}}', "invalid_base64", "item.content[0].audio", None),
    ('{"type": "conversation.item.create", "item": {"type": "message", "role": "user", "content": '
     '[{"type": "input_text", "text": "a"}, {"type": "output_text", "text": "b"}]}}', "invalid_value",
     "item.content[1].type", None),
    ('{"type": "conversation.item.create", "item": {"type": "message", "role": "user", "content": '
     '[{"type": "input_text", "text": 1}]}}', "invalid_type", "item.content[0].text", None),
    ('{"type": "conversation.item.create", "item": {"type": "message", "role": "user", "content": '
     '[{"type": "input_text", "text": "a", "lang": "en"}]}}', "unknown_parameter", "item.content[0].lang", None),
    ('{"type": "response.create", "response": {"conversation": "conv_1"}}', "unsupported", "response.conversation",
     None),
    ('{"type": "response.create", "response": {"input": []}}', "unsupported", "response.input", None),
    ('{"type": "response.create", "response": {"tools": [{"type": "mcp", "server_label": "x"}]}}', "unsupported",
     "response.tools[0].type", None),
    ('{"type": "response.create", "response": {"tool_choice": "sometimes"}}', "invalid_value",
     "response.tool_choice", None),
    ('{"type": "response.create", "response": {"output_modalities": ["video"]}}', "invalid_value",
     "response.output_modalities[0]", None),
    ('{"type": "response.create", "response": {"max_output_tokens": 0}}', "invalid_value",
     "response.max_output_tokens", None),
    ('{"type": "response.create", "response": {"metadata": {"k": 1}}}', "invalid_type", "response.metadata.k",
     None),
    ('{"type": "response.create", "response": {"audio": {"output": {"format": {"type": "audio/pcm", '
     '"rate": 16000}}}}}', "invalid_value", "response.audio.output.format.rate", None),
    ('{"type": "response.create", "response": {"output_audio_format": "mp3"}}', "invalid_value",
     "response.output_audio_format", None),
    ('{"type": "session.update", "event_id": "u", "session": {"audio": {"input": {"format": {"type": "audio/pcm", '
     '"rate": 16000}}}}}', "invalid_value", "session.audio.input.format.rate", "u"),
    ('{"type": "session.update", "session": {"audio": {"input": {"format": {"type": "audio/opus"}}}}}',
     "invalid_value", "session.audio.input.format.type", None),
    ('{"type": "session.update", "session": {"input_audio_format": "pcm24"}}', "invalid_value",
     "session.input_audio_format", None),
    ('{"type": "session.update", "session": {"turn_detection": {"type": "semantic_vad", "eagerness": "eager"}}}',
     "invalid_value", "session.turn_detection.eagerness", None),
    ('{"type": "session.update", "session": {"audio": {"input": {"turn_detection": {"type": "semantic_vad", '
     '"silence_duration_ms": 500}}}}}', "unknown_parameter", "session.audio.input.turn_detection.silence_duration_ms",
     None),
    ('{"type": "session.update", "session": {"audio": {"input": {"turn_detection": {"threshold": 0.3}}}}}',
     "missing_required_parameter", "session.audio.input.turn_detection.type", None),
    ('{"type": "session.update", "session": {"turn_detection": {"type": "server_vad", "threshold": 1.5}}}',
     "invalid_value", "session.turn_detection.threshold", None),
    ('{"type": "session.update", "session": {"turn_detection": {"type": "server_vad", "silence_ms": 1}}}',
     "unknown_parameter", "session.turn_detection.silence_ms", None),
    ('{"type": "session.update", "session": {"custom_voice_id": "x"}}', "unknown_parameter",
     "session.custom_voice_id", None),
    ('{"type": "session.update", "session": {"audio": {"output": {"pitch": 2}}}}', "unknown_parameter",
     "session.audio.output.pitch", None),
    ('{"type": "session.update", "session": {"audio": {"output": {"speed": 3}}}}', "invalid_value",
     "session.audio.output.speed", None),
    ('{"type": "session.update", "session": {"instructions": 5}}', "invalid_type", "session.instructions", None),
    ('{"type": "session.update", "session": {"output_modalities": "audio"}}', "invalid_type",
     "session.output_modalities", None),
    ('{"type": "session.update", "session": {"type": "transcription"}}', "unsupported", "session.type", None),
    ('{"type": "session.update", "session": {"type": "realtime2"}}', "invalid_value", "session.type", None),
    ('{"type": "session.update", "session": {"tools": [{"type": "mcp", "server_label": "x"}]}}', "unsupported",
     "session.tools[0].type", None),
    ('{"type": "session.update", "session": {"tools": [{"type": "function", "name": "f", "parameters": '
     '{"type": "objekt"}}]}}', "invalid_value", "session.tools[0].parameters", None),
    ('{"type": "session.update", "session": {"max_output_tokens": 5000}}', "invalid_value",
     "session.max_output_tokens", None),
    ('{"type": "session.update", "session": {"max_response_output_tokens": "lots"}}', "invalid_value",
     "session.max_response_output_tokens", None),
    ('{"type": "session.update", "session": {"voice": ""}}', "invalid_value", "session.voice", None),
    ('{"type": "session.update", "session": {"audio": null}}', "invalid_type", "session.audio", None),
    ('{"type": "session.update"}', "missing_required_parameter", "session", None),
]


@pytest.mark.parametrize(("frame", "code", "param", "event_id"), BAD_EVENTS)
def test_malformed_events_give_errors(frame: str | bytes, code: str, param: str | None,
                                      event_id: str | None) -> None:
    error = parse_client_event(frame)
    assert isinstance(error, ProtocolError), error
    assert (error.code, error.param, error.event_id) == (code, param, event_id), error.message
    assert error.code in ERROR_CODES
    event = error.to_event()
    assert event["type"] == "error" and event["event_id"].startswith("event_")
    assert event["error"] == {"type": "invalid_request_error", "code": code, "message": error.message,
                              "param": param, "event_id": event_id}
    json.dumps(event)


def test_oversize_audio_and_frames_are_refused_before_decoding() -> None:
    over = "A" * (4 * (MAX_AUDIO_BYTES // 3 + 2))
    error = _parse({"type": "input_audio_buffer.append", "event_id": "big", "audio": over})
    assert isinstance(error, ProtocolError)
    assert (error.code, error.param, error.event_id) == ("audio_too_large", "audio", "big")
    error = parse_client_event(" " * (MAX_EVENT_CHARS + 1))
    assert isinstance(error, ProtocolError) and error.code == "event_too_large"


def test_audio_at_the_limit_is_accepted() -> None:
    audio = bytes(MAX_AUDIO_BYTES)
    event = _parse({"type": "input_audio_buffer.append", "audio": base64.b64encode(audio).decode()})
    assert isinstance(event, InputAudioBufferAppend) and len(event.audio) == MAX_AUDIO_BYTES


@pytest.mark.parametrize("frame", ["", "null", "1e999", '{"type": null}', '{"type": "session.update", "session": []}',
                                   "[" * 100_000, '{"type": "response.create", "response": {"metadata": '
                                   + json.dumps({f"k{i}": "v" for i in range(17)}) + "}}",
                                   "\ud800", '{"type": "input_audio_buffer.append", "audio": "\\ud800"}'])
def test_odd_frames_never_raise(frame: str) -> None:
    assert isinstance(parse_client_event(frame), ProtocolError)
