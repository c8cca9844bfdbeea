"""The official OpenAI SDK as the reference schema: the server events we build validate against its pydantic
server-event models with no unknown key (but our documented vendor key), and its client-event models,
dumped as a client would send them, parse with ours."""

from __future__ import annotations

import json
import typing
from typing import Any

import pydantic
import pytest
from openai.types.realtime import (
    ConversationItemCreateEvent,
    ConversationItemDeleteEvent,
    ConversationItemTruncateEvent,
    InputAudioBufferAppendEvent,
    InputAudioBufferClearEvent,
    InputAudioBufferCommitEvent,
    RealtimeClientEvent,
    RealtimeServerEvent,
    ResponseCancelEvent,
    ResponseCreateEvent,
    SessionUpdateEvent,
)

from voice_server.session.realtime import (
    DEFAULT_SESSION,
    ProtocolError,
    ResponseUsage,
    SessionUpdate,
    new_item_id,
    new_response_id,
    parse_client_event,
)
from voice_server.session.realtime import server_events as se

SERVER_EVENTS: pydantic.TypeAdapter[Any] = pydantic.TypeAdapter(RealtimeServerEvent)


def _extra_keys(value: object, path: str = "") -> list[str]:
    """Keys the SDK model kept as extras (unknown to the schema), anywhere in a parsed model."""
    found: list[str] = []
    if isinstance(value, pydantic.BaseModel):
        found += [f"{path}.{key}" for key in (value.model_extra or {})]
        for name in type(value).model_fields:
            found += _extra_keys(getattr(value, name), f"{path}.{name}")
    elif isinstance(value, list):
        for index, item in enumerate(value):
            found += _extra_keys(item, f"{path}[{index}]")
    return found


def _built_events() -> list[dict[str, Any]]:
    rid, item_id, user_id = new_response_id(), new_item_id(), new_item_id()
    g711 = DEFAULT_SESSION.updated({"audio": {"output": {"format": {"type": "audio/pcmu"}}},
                                    "output_modalities": ["text"]})
    manual = DEFAULT_SESSION.updated({"audio": {"input": {"turn_detection": None, "transcription": {"model": "m"},
                                                          "noise_reduction": {"type": "near_field"}}}})
    user = se.message_item(user_id, "user", [se.input_audio_part()])
    typed = se.message_item(new_item_id(), "system", [se.input_text_part("Be kind.")])
    partial = se.message_item(item_id, "assistant", [se.output_audio_part()], status="in_progress")
    final = se.message_item(item_id, "assistant", [se.output_audio_part("Hi there.")])
    text_item = se.message_item(item_id, "assistant", [se.output_text_part("Hi.")], status="incomplete")
    usage = ResponseUsage(num_input_text_tokens=40, num_input_audio_tokens=60, num_cached_tokens=30,
                          num_output_text_tokens=5, num_output_audio_tokens=50)
    return [
        se.session_created(DEFAULT_SESSION), se.session_updated(g711), se.session_updated(manual),
        se.speech_started(1200, user_id), se.speech_stopped(2900, user_id),
        se.input_audio_committed(user_id, None), se.input_audio_committed(user_id, "item_prev"),
        se.input_audio_cleared(), se.timeout_triggered(0, 6000, user_id),
        se.conversation_item_added(user, None), se.conversation_item_done(typed, user_id),
        se.conversation_item_truncated(item_id, 0, 850), se.conversation_item_deleted(item_id),
        se.response_created(se.response_object(rid, "in_progress")),
        se.output_item_added(rid, 0, partial),
        se.content_part_added(rid, item_id, 0, 0, is_audio=True),
        se.output_audio_delta(rid, item_id, 0, 0, b"\x01\x02" * 480),
        se.output_audio_transcript_delta(rid, item_id, 0, 0, "Hi "),
        se.output_audio_transcript_done(rid, item_id, 0, 0, "Hi there."),
        se.output_audio_done(rid, item_id, 0, 0),
        se.content_part_done(rid, item_id, 0, 0, is_audio=True, text="Hi there."),
        se.output_item_done(rid, 0, final),
        se.content_part_added(rid, item_id, 0, 0, is_audio=False),
        se.output_text_delta(rid, item_id, 0, 0, "Hi"), se.output_text_done(rid, item_id, 0, 0, "Hi."),
        se.content_part_done(rid, item_id, 0, 0, is_audio=False, text="Hi."),
        se.response_done(se.response_object(rid, "completed", output=[final], usage=usage, metadata={"k": "v"},
                                            timings_ms={"asr": 12.5, "llm_first_token": 80, "tts_first_audio": 40})),
        se.response_done(se.response_object(rid, "cancelled", reason="turn_detected", output=[partial])),
        se.response_done(se.response_object(rid, "cancelled", reason="client_cancelled")),
        se.response_done(se.response_object(rid, "incomplete", reason="max_output_tokens", output=[text_item],
                                            output_modalities=("text",), max_output_tokens=20)),
        se.response_done(se.response_object(rid, "failed", error={"type": "server_error", "code": "engine_error",
                                                                   "message": "stage died"})),
        se.error_event("invalid_value", "bad", param="type", client_event_id="evt_1"),
        ProtocolError("invalid_json", "not JSON").to_event(),
    ]


@pytest.mark.parametrize("event", _built_events(), ids=lambda event: event["type"])
def test_built_server_events_validate_with_the_sdk(event: dict[str, Any]) -> None:
    wire = json.loads(json.dumps(event))
    model = SERVER_EVENTS.validate_python(wire)
    assert model.type == event["type"] and model.event_id.startswith("event_")
    extras = _extra_keys(model)
    # NOTE: the vendor key (timings on a response, what is served on session.created) is the one extra.
    assert extras in ([], [f".response.{se.VENDOR_KEY}"], [f".session.{se.VENDOR_KEY}"]), extras


def test_timings_survive_sdk_parsing() -> None:
    event = se.response_done(se.response_object(new_response_id(), "completed", timings_ms={"llm": 81.0}))
    model = SERVER_EVENTS.validate_python(event)
    assert model.response.model_extra == {se.VENDOR_KEY: {"timings_ms": {"llm": 81.0}}}
    assert model.response.usage is None


def test_ids_are_fresh_and_prefixed() -> None:
    ids = {se.new_event_id() for _ in range(1000)}
    assert len(ids) == 1000 and all(i.startswith("event_") for i in ids)
    assert new_item_id().startswith("item_") and new_response_id().startswith("resp_")


SDK_CLIENT_EVENTS = [
    SessionUpdateEvent.model_validate({"type": "session.update", "event_id": "e1", "session": {
        "type": "realtime", "instructions": "Hi", "output_modalities": ["audio"], "max_output_tokens": 512,
        "audio": {"input": {"format": {"type": "audio/pcmu"}, "noise_reduction": {"type": "far_field"},
                            "transcription": {"model": "gpt-4o-transcribe", "language": "en"},
                            "turn_detection": {"type": "server_vad", "threshold": 0.4, "prefix_padding_ms": 200,
                                               "silence_duration_ms": 400, "create_response": True,
                                               "interrupt_response": False, "idle_timeout_ms": 8000}},
                  "output": {"format": {"type": "audio/pcm", "rate": 24000}, "voice": "marin", "speed": 1.1}}}}),
    InputAudioBufferAppendEvent(type="input_audio_buffer.append", audio="AAAAAA==", event_id="e2"),
    InputAudioBufferCommitEvent(type="input_audio_buffer.commit"),
    InputAudioBufferClearEvent(type="input_audio_buffer.clear"),
    ConversationItemCreateEvent.model_validate({"type": "conversation.item.create", "previous_item_id": "root",
                                                "item": {"type": "message", "role": "user",
                                                         "content": [{"type": "input_text", "text": "Hello"}]}}),
    ConversationItemTruncateEvent(type="conversation.item.truncate", item_id="item_1", content_index=0,
                                  audio_end_ms=640),
    ConversationItemDeleteEvent(type="conversation.item.delete", item_id="item_1"),
    ResponseCreateEvent.model_validate({"type": "response.create", "response": {
        "instructions": "Shorter.", "output_modalities": ["text"], "conversation": "none", "metadata": {"a": "b"},
        "audio": {"output": {"voice": "cedar", "format": {"type": "audio/pcma"}}}, "max_output_tokens": "inf"}}),
    ResponseCancelEvent(type="response.cancel", response_id="resp_1"),
]


@pytest.mark.parametrize("model", SDK_CLIENT_EVENTS, ids=lambda model: model.type)
def test_sdk_client_events_parse_with_ours(model: pydantic.BaseModel) -> None:
    frame = model.model_dump_json(exclude_unset=True)
    event = parse_client_event(frame)
    assert not isinstance(event, ProtocolError), event
    assert event.event_id == getattr(model, "event_id", None)
    if isinstance(event, SessionUpdate):
        session = DEFAULT_SESSION.updated(event.patch)
        assert session.voice == "marin" and session.input_format.is_g711 and session.speed == 1.1
        assert session.turn_detection is not None and session.turn_detection.idle_timeout_ms == 8000


def test_every_sdk_client_event_type_is_served_or_refused_as_unsupported() -> None:
    types = [typing.get_args(cls.model_fields["type"].annotation)[0]
             for cls in typing.get_args(typing.get_args(RealtimeClientEvent)[0])]
    for kind in types:
        result = parse_client_event(json.dumps({"type": kind}))
        # A bare event lacks required fields for most types; what matters is that the type is known.
        assert not (isinstance(result, ProtocolError) and result.param == "type" and result.code != "unsupported"), \
            (kind, result)


def test_the_extra_key_check_catches_unknown_keys() -> None:
    event = se.session_created(DEFAULT_SESSION)
    event["session"]["audio"]["output"]["pitch"] = 2
    model = SERVER_EVENTS.validate_python(event)
    assert type(model.session).__name__ == "RealtimeSessionCreateRequest"
    assert _extra_keys(model) == [f".session.{se.VENDOR_KEY}", ".session.audio.output.pitch"]
