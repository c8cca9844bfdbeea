"""The OpenAI Realtime protocol (GA, plus the beta spellings on input) over JSON text frames.

- ``events``: ``parse_client_event(frame)`` -> a typed client event or a ``ProtocolError``;
- ``payloads``: the message of ``conversation.item.create`` and the overrides of ``response.create``;
- ``session_config``: ``SessionConfig``, the one internal form of GA and beta sessions, and
  ``session.update``'s PATCH merge;
- ``session_fields``: audio formats, ``server_vad`` and the other field parsers both share;
- ``server_events``: builders of the server events (GA names only);
- ``errors``: ``ProtocolError`` and the table of error codes;
- ``endpoint``: ``WS /v1/realtime`` over a ``Session`` (``adapt``: config and audio formats; ``handlers``:
  client events -> the session; ``bridge``: session events -> server events). Import it from there: it
  pulls in the session core and starlette.
"""

from __future__ import annotations

from voice_server.session.realtime.errors import ERROR_CODES, ProtocolError
from voice_server.session.realtime.events import (
    MAX_AUDIO_BYTES,
    MAX_EVENT_CHARS,
    ClientEvent,
    ConversationItemCreate,
    ConversationItemDelete,
    ConversationItemTruncate,
    InputAudioBufferAppend,
    InputAudioBufferClear,
    InputAudioBufferCommit,
    ResponseCancel,
    ResponseCreate,
    SessionUpdate,
    parse_client_event,
)
from voice_server.session.realtime.payloads import MessageItem, ResponseOverrides
from voice_server.session.realtime.server_events import ResponseUsage, new_event_id, new_item_id, new_response_id
from voice_server.session.realtime.session_config import DEFAULT_SESSION, SessionConfig
from voice_server.session.realtime.session_fields import AudioFormat, ServerVad

__all__ = [
    "DEFAULT_SESSION",
    "ERROR_CODES",
    "MAX_AUDIO_BYTES",
    "MAX_EVENT_CHARS",
    "AudioFormat",
    "ClientEvent",
    "ConversationItemCreate",
    "ConversationItemDelete",
    "ConversationItemTruncate",
    "InputAudioBufferAppend",
    "InputAudioBufferClear",
    "InputAudioBufferCommit",
    "MessageItem",
    "ProtocolError",
    "ResponseCancel",
    "ResponseCreate",
    "ResponseOverrides",
    "ResponseUsage",
    "ServerVad",
    "SessionConfig",
    "SessionUpdate",
    "new_event_id",
    "new_item_id",
    "new_response_id",
    "parse_client_event",
]
