"""Fuzz: the OpenAI Realtime client-event parser and ``session.update`` merging never raise.

Documented outcomes (``voice_server/session/realtime/errors.py``): ``parse_client_event`` returns a typed
event or a ``ProtocolError`` whose code is in ``ERROR_CODES``; a parsed ``session.update`` patch merges
into any valid session (``SessionConfig.updated``), and turning the result into the core config fails
only with ValueError (the endpoint answers it ``invalid_value``).
"""

from __future__ import annotations

import contextlib
import json

from fuzz_values import FUZZ, frames, json_values, numbers, objects, scalars, shaped
from hypothesis import example, given
from hypothesis import strategies as st

from voice_server.session.realtime import (
    DEFAULT_SESSION,
    ERROR_CODES,
    ProtocolError,
    SessionConfig,
    SessionUpdate,
    parse_client_event,
)
from voice_server.session.realtime.adapt import core_config
from voice_server.session.realtime.errors import BINARY_FRAME

EVENT_TYPES = ["session.update", "input_audio_buffer.append", "input_audio_buffer.commit",
               "input_audio_buffer.clear", "conversation.item.create", "conversation.item.truncate",
               "conversation.item.delete", "response.create", "response.cancel", "conversation.item.retrieve",
               "output_audio_buffer.clear", "transcription_session.update"]
WORDS = [
    *EVENT_TYPES, "type", "event_id", "session", "audio", "input", "output", "format", "rate", "turn_detection",
    "transcription", "noise_reduction", "voice", "speed", "server_vad", "semantic_vad", "audio/pcm", "audio/pcmu",
    "audio/pcma", "pcm16", "g711_ulaw", "g711_alaw", "text", "realtime", "item", "content", "role", "user",
    "assistant", "system", "message", "input_text", "output_text", "input_audio", "item_id", "content_index",
    "audio_end_ms", "response", "response_id", "previous_item_id", "id", "conversation", "auto", "none", "metadata",
    "instructions", "output_modalities", "modalities", "max_output_tokens", "max_response_output_tokens", "inf",
    "tools", "prompt", "near_field", "far_field", "strength", "model", "language", "threshold", "prefix_padding_ms",
    "silence_duration_ms", "create_response", "interrupt_response", "idle_timeout_ms", "temperature",
    "input_audio_format", "output_audio_format", "input_audio_transcription", "input_audio_noise_reduction",
    "alloy", "AAAA", "UklGRg==", "tool_choice", "status",
]
ANY = st.one_of(numbers(), scalars(WORDS))
FORMATS = shaped({"type": st.one_of(st.sampled_from(["audio/pcm", "audio/pcmu", "audio/pcma"]), ANY),
                  "rate": st.one_of(st.sampled_from([24000, 8000]), ANY)}, WORDS)
VADS = shaped({key: ANY for key in ("threshold", "prefix_padding_ms", "silence_duration_ms", "create_response",
                                   "interrupt_response", "idle_timeout_ms")}, WORDS,
              {"type": st.sampled_from(["server_vad", "semantic_vad", "x"])})
NOISE = shaped({"type": st.one_of(st.sampled_from(["near_field", "far_field"]), ANY), "strength": ANY}, WORDS)
AUDIO = shaped({
    "input": shaped({"format": FORMATS, "turn_detection": st.one_of(st.none(), VADS), "noise_reduction": NOISE,
                     "transcription": shaped({"model": ANY, "language": ANY, "prompt": ANY}, WORDS)}, WORDS),
    "output": shaped({"format": FORMATS, "voice": st.one_of(ANY, shaped({"id": ANY})), "speed": ANY}, WORDS),
}, WORDS)
MODALITIES = st.one_of(st.lists(st.sampled_from(["audio", "text"]), max_size=2), ANY)
SESSIONS = st.one_of(shaped({
    "type": ANY, "output_modalities": MODALITIES, "modalities": MODALITIES, "instructions": ANY, "audio": AUDIO,
    "max_output_tokens": ANY, "max_response_output_tokens": ANY, "temperature": ANY, "tools": ANY, "prompt": ANY,
    "turn_detection": st.one_of(st.none(), VADS), "input_audio_format": ANY, "output_audio_format": ANY,
    "voice": ANY, "speed": ANY, "input_audio_noise_reduction": NOISE}, WORDS), json_values(WORDS, max_leaves=40))
ITEMS = shaped({"type": st.sampled_from(["message", "function_call"]), "id": ANY,
                "role": st.sampled_from(["user", "assistant", "system", "tool"]),
                "content": st.lists(shaped({"type": st.sampled_from(["input_text", "output_text", "text", "audio"]),
                                            "text": ANY}, WORDS), max_size=3)}, WORDS)
RESPONSES = shaped({"instructions": ANY, "output_modalities": MODALITIES, "conversation": ANY, "voice": ANY,
                    "audio": shaped({"output": shaped({"format": FORMATS, "voice": ANY})}), "temperature": ANY,
                    "max_output_tokens": ANY, "metadata": json_values(WORDS), "output_audio_format": ANY}, WORDS)
EVENTS = st.one_of(
    objects(WORDS, {"type": st.sampled_from(EVENT_TYPES)}),
    shaped({"session": SESSIONS}, WORDS, {"type": st.just("session.update")}),
    shaped({"item": ITEMS, "previous_item_id": ANY}, WORDS, {"type": st.just("conversation.item.create")}),
    shaped({"response": RESPONSES}, WORDS, {"type": st.just("response.create")}),
    shaped({"item_id": ANY, "content_index": ANY, "audio_end_ms": ANY, "audio": ANY, "response_id": ANY}, WORDS,
           {"type": st.sampled_from(EVENT_TYPES)}))
SESSION_UPDATES = st.fixed_dictionaries({"type": st.just("session.update"), "session": SESSIONS})


def check(frame: str | bytes) -> object:
    event = parse_client_event(frame)
    if isinstance(event, ProtocolError):
        assert event.code in ERROR_CODES
        json.dumps(event.to_event())
    return event


@FUZZ
@example(json.dumps({"type": "session.update", "session": {"temperature": 10**400}}))  # was an OverflowError
@example(json.dumps({"type": "session.update", "session": {"input_audio_noise_reduction": {"strength": 10**400}}}))
@given(frames(st.one_of(EVENTS, json_values(WORDS))))
def test_any_frame_is_an_event_or_a_protocol_error(frame: str | bytes) -> None:
    event = check(frame)
    if isinstance(frame, bytes):
        assert isinstance(event, ProtocolError) and event.code == BINARY_FRAME


@FUZZ
@given(st.lists(SESSION_UPDATES, min_size=1, max_size=3))
def test_parsed_session_updates_merge_into_any_valid_session(updates: list[dict[str, object]]) -> None:
    config: SessionConfig = DEFAULT_SESSION
    for update in updates:
        event = check(json.dumps(update))
        if not isinstance(event, SessionUpdate):
            continue
        # NOTE: documented in session_config: a validated patch merges into any valid session.
        config = config.updated(event.patch)
        json.dumps(config.to_ga_dict())
        # NOTE: ValueError is the server's own bounds (e.g. prefix_padding_ms), answered invalid_value.
        with contextlib.suppress(ValueError):
            core_config(config)
