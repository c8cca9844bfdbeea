"""Client events of the Realtime protocol: ``parse_client_event(frame)`` -> a typed event or a ProtocolError.

Served: ``session.update``, ``input_audio_buffer.append|commit|clear``, ``conversation.item.create|
truncate|delete``, ``response.create``, ``response.cancel``. ``conversation.item.retrieve``,
``output_audio_buffer.clear`` (WebRTC/SIP only at OpenAI) and ``transcription_session.update`` are
answered ``unsupported``; any other ``type`` is ``invalid_value``. The error codes are tabled in
``errors``. Beta spellings are accepted inside payloads (``session_config``, ``payloads``).

``input_audio_buffer.append`` is decoded to bytes here, in whatever format the session has; checking
the length against the format is the session's job.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

from voice_server.audio import b64decode
from voice_server.session.realtime.errors import (
    AUDIO_TOO_LARGE,
    BINARY_FRAME,
    EVENT_TOO_LARGE,
    INVALID_BASE64,
    INVALID_EVENT,
    INVALID_JSON,
    INVALID_VALUE,
    UNSUPPORTED,
    FieldError,
    ProtocolError,
    as_int,
    as_str,
    check_keys,
    invalid_type,
    require,
)
from voice_server.session.realtime.payloads import (
    ClientItem,
    ResponseOverrides,
    parse_id,
    parse_item,
    parse_response_overrides,
)
from voice_server.session.realtime.session_config import normalize_session_patch

MAX_AUDIO_BYTES = 15 * 1024 * 1024  # OpenAI's documented limit per input_audio_buffer.append
# NOTE: base64 of 15 MiB is 20 MiB of text; 1 MiB on top leaves room for the JSON around it, and
# anything longer is refused before json.loads spends time and memory on it.
MAX_EVENT_CHARS = 4 * ((MAX_AUDIO_BYTES + 2) // 3) + 1024 * 1024

_UNSUPPORTED_TYPES = frozenset({"conversation.item.retrieve", "output_audio_buffer.clear",
                                "transcription_session.update"})


@dataclass(frozen=True)
class SessionUpdate:
    """``patch`` is the validated update in the GA shape; apply it with ``SessionConfig.updated``."""

    patch: Mapping[str, Any]
    event_id: str | None = None


@dataclass(frozen=True)
class InputAudioBufferAppend:
    audio: bytes
    event_id: str | None = None

    def __post_init__(self) -> None:
        if len(self.audio) > MAX_AUDIO_BYTES:
            raise ValueError(f"audio holds {len(self.audio)} bytes, over the {MAX_AUDIO_BYTES} limit")


@dataclass(frozen=True)
class InputAudioBufferCommit:
    event_id: str | None = None


@dataclass(frozen=True)
class InputAudioBufferClear:
    event_id: str | None = None


@dataclass(frozen=True)
class ConversationItemCreate:
    item: ClientItem
    previous_item_id: str | None = None
    event_id: str | None = None


@dataclass(frozen=True)
class ConversationItemTruncate:
    item_id: str
    content_index: int
    audio_end_ms: int
    event_id: str | None = None

    def __post_init__(self) -> None:
        if self.content_index < 0 or self.audio_end_ms < 0:
            raise ValueError(f"content_index and audio_end_ms must be >= 0, got {self.content_index}, "
                             f"{self.audio_end_ms}")


@dataclass(frozen=True)
class ConversationItemDelete:
    item_id: str
    event_id: str | None = None


@dataclass(frozen=True)
class ResponseCreate:
    response: ResponseOverrides = field(default_factory=ResponseOverrides)
    event_id: str | None = None


@dataclass(frozen=True)
class ResponseCancel:
    response_id: str | None = None
    event_id: str | None = None


ClientEvent = (SessionUpdate | InputAudioBufferAppend | InputAudioBufferCommit | InputAudioBufferClear
               | ConversationItemCreate | ConversationItemTruncate | ConversationItemDelete | ResponseCreate
               | ResponseCancel)


def parse_client_event(frame: str | bytes) -> ClientEvent | ProtocolError:
    """One WebSocket frame -> its event, or the error to send back. Never raises for client input."""
    if isinstance(frame, bytes | bytearray | memoryview):
        return ProtocolError(BINARY_FRAME, "Binary frames are not supported; send JSON events as text frames.")
    if len(frame) > MAX_EVENT_CHARS:
        return ProtocolError(EVENT_TOO_LARGE, f"Event of {len(frame)} characters is over the limit of "
                                              f"{MAX_EVENT_CHARS}.")
    try:
        obj = json.loads(frame)
    except (ValueError, RecursionError) as exc:
        return ProtocolError(INVALID_JSON, f"The event is not valid JSON: {exc}.")
    if not isinstance(obj, dict):
        return ProtocolError(INVALID_EVENT, f"An event must be a JSON object, got {type(obj).__name__}.")
    event_id = obj.get("event_id")
    if event_id is not None and not isinstance(event_id, str):
        return invalid_type("event_id", "a string", event_id).to_protocol_error(None)
    try:
        return _parse_event(obj, event_id)
    except FieldError as exc:
        return exc.to_protocol_error(event_id)


def _parse_event(obj: Mapping[str, Any], event_id: str | None) -> ClientEvent | ProtocolError:
    kind = as_str(require(obj, "type", ""), "type")
    parser = _PARSERS.get(kind)
    if parser is None:
        if kind in _UNSUPPORTED_TYPES:
            return ProtocolError(UNSUPPORTED, f"The event type '{kind}' is not supported by this server.", "type",
                                 event_id)
        supported = ", ".join(f"'{name}'" for name in _PARSERS)
        return ProtocolError(INVALID_VALUE, f"Invalid value: '{kind}'. Supported values are: {supported}.", "type",
                             event_id)
    fields, allowed = parser
    check_keys(obj, "", {"type", "event_id", *allowed})
    return fields(obj, event_id)


def _session_update(obj: Mapping[str, Any], event_id: str | None) -> ClientEvent:
    # NOTE: read-only at the top so a handler cannot edit the patch it is about to apply.
    return SessionUpdate(MappingProxyType(normalize_session_patch(require(obj, "session", ""), "session")), event_id)


def _append(obj: Mapping[str, Any], event_id: str | None) -> ClientEvent | ProtocolError:
    payload = as_str(require(obj, "audio", ""), "audio")
    # NOTE: base64 length bounds the decoded size, so oversize audio is refused without decoding it.
    if len(payload) // 4 * 3 > MAX_AUDIO_BYTES + 2:
        return ProtocolError(AUDIO_TOO_LARGE, f"Audio of about {len(payload) // 4 * 3} bytes is over the "
                                              f"{MAX_AUDIO_BYTES}-byte limit per event.", "audio", event_id)
    try:
        audio = b64decode(payload)
    except ValueError as exc:
        return ProtocolError(INVALID_BASE64, f"Invalid 'audio': {exc}.", "audio", event_id)
    if len(audio) > MAX_AUDIO_BYTES:
        return ProtocolError(AUDIO_TOO_LARGE, f"Audio of {len(audio)} bytes is over the {MAX_AUDIO_BYTES}-byte "
                                              f"limit per event.", "audio", event_id)
    return InputAudioBufferAppend(audio, event_id)


def _item_create(obj: Mapping[str, Any], event_id: str | None) -> ClientEvent:
    previous = obj.get("previous_item_id")
    return ConversationItemCreate(parse_item(require(obj, "item", ""), "item"),
                                  None if previous is None else parse_id(previous, "previous_item_id"), event_id)


def _truncate(obj: Mapping[str, Any], event_id: str | None) -> ClientEvent:
    return ConversationItemTruncate(
        parse_id(require(obj, "item_id", ""), "item_id"),
        as_int(require(obj, "content_index", ""), "content_index", minimum=0),
        as_int(require(obj, "audio_end_ms", ""), "audio_end_ms", minimum=0), event_id)


def _delete(obj: Mapping[str, Any], event_id: str | None) -> ClientEvent:
    return ConversationItemDelete(parse_id(require(obj, "item_id", ""), "item_id"), event_id)


def _response_create(obj: Mapping[str, Any], event_id: str | None) -> ClientEvent:
    raw = obj.get("response")
    return ResponseCreate(ResponseOverrides() if raw is None else parse_response_overrides(raw, "response"), event_id)


def _response_cancel(obj: Mapping[str, Any], event_id: str | None) -> ClientEvent:
    raw = obj.get("response_id")
    return ResponseCancel(None if raw is None else parse_id(raw, "response_id"), event_id)


_PARSERS = {
    "session.update": (_session_update, {"session"}),
    "input_audio_buffer.append": (_append, {"audio"}),
    "input_audio_buffer.commit": (lambda obj, eid: InputAudioBufferCommit(eid), set()),
    "input_audio_buffer.clear": (lambda obj, eid: InputAudioBufferClear(eid), set()),
    "conversation.item.create": (_item_create, {"item", "previous_item_id"}),
    "conversation.item.truncate": (_truncate, {"item_id", "content_index", "audio_end_ms"}),
    "conversation.item.delete": (_delete, {"item_id"}),
    "response.create": (_response_create, {"response"}),
    "response.cancel": (_response_cancel, {"response_id"}),
}

