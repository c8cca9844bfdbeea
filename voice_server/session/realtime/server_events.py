"""Builders of the Realtime server events (GA names only), as plain dicts ready for ``json.dumps``.

Every event gets a fresh ``event_id`` (``event_<hex>``); ids of items and responses come from
``new_item_id`` (``item_<hex>``) and ``new_response_id`` (``resp_<hex>``). Audio deltas take raw bytes
already in the session's output format and base64 them here.

Per-stage timings ride on ``response.done`` under the vendor key ``response.x_voice_server``
(``{"timings_ms": {stage: ms}}``): the SDK's models allow extra keys, so its parsing keeps working,
whereas ``response.metadata`` is the client's (string values only, at most 16 keys) and is echoed as sent.
"""

from __future__ import annotations

import secrets
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from voice_server.audio import b64encode
from voice_server.session.realtime.capabilities import capabilities

if TYPE_CHECKING:
    from voice_server.session.realtime.session_config import SessionConfig

RESPONSE_STATUSES = ("in_progress", "completed", "cancelled", "incomplete", "failed")
# NOTE: the reasons OpenAI's schema allows, per final status; anything else would fail SDK parsing.
STATUS_REASONS = {"cancelled": ("turn_detected", "client_cancelled"),
                  "incomplete": ("max_output_tokens", "content_filter")}
VENDOR_KEY = "x_voice_server"


def _new_id(prefix: str) -> str:
    return f"{prefix}_{secrets.token_hex(10)}"


def new_event_id() -> str:
    return _new_id("event")


def new_item_id() -> str:
    return _new_id("item")


def new_response_id() -> str:
    return _new_id("resp")


def server_event(event_type: str, **fields: Any) -> dict[str, Any]:
    return {"type": event_type, "event_id": new_event_id(), **fields}


@dataclass(frozen=True)
class ResponseUsage:
    """Token counts of one response (``usage`` of ``response.done``)."""

    num_input_text_tokens: int = 0
    num_input_audio_tokens: int = 0
    num_cached_tokens: int = 0
    num_output_text_tokens: int = 0
    num_output_audio_tokens: int = 0

    def __post_init__(self) -> None:
        counts = (self.num_input_text_tokens, self.num_input_audio_tokens, self.num_cached_tokens,
                  self.num_output_text_tokens, self.num_output_audio_tokens)
        if min(counts) < 0:
            raise ValueError(f"token counts must be >= 0, got {counts}")
        if self.num_cached_tokens > self.num_input_text_tokens + self.num_input_audio_tokens:
            raise ValueError("cached tokens are a subset of the input tokens")

    def to_dict(self) -> dict[str, Any]:
        num_input = self.num_input_text_tokens + self.num_input_audio_tokens
        num_output = self.num_output_text_tokens + self.num_output_audio_tokens
        return {"total_tokens": num_input + num_output, "input_tokens": num_input, "output_tokens": num_output,
                "input_token_details": {"text_tokens": self.num_input_text_tokens,
                                        "audio_tokens": self.num_input_audio_tokens,
                                        "cached_tokens": self.num_cached_tokens},
                "output_token_details": {"text_tokens": self.num_output_text_tokens,
                                         "audio_tokens": self.num_output_audio_tokens}}


# ---- items ----------------------------------------------------------------------------------------

def message_item(item_id: str, role: str, content: Sequence[Mapping[str, Any]], *,
                 status: str = "completed") -> dict[str, Any]:
    """A ``realtime.item`` message; content parts are GA dicts (see the ``*_part`` helpers)."""
    if role not in ("user", "assistant", "system"):
        raise ValueError(f"role must be user, assistant or system, got {role!r}")
    if status not in ("completed", "incomplete", "in_progress"):
        raise ValueError(f"item status must be completed, incomplete or in_progress, got {status!r}")
    return {"id": item_id, "object": "realtime.item", "type": "message", "status": status, "role": role,
            "content": [dict(part) for part in content]}


def input_text_part(text: str) -> dict[str, Any]:
    return {"type": "input_text", "text": text}


def input_audio_part(transcript: str | None = None) -> dict[str, Any]:
    # NOTE: the server never echoes the user's audio bytes back; transcript stays null until known.
    return {"type": "input_audio", "transcript": transcript}


def input_image_part() -> dict[str, Any]:
    return {"type": "input_image"}


def output_audio_part(transcript: str = "") -> dict[str, Any]:
    return {"type": "output_audio", "transcript": transcript}


def output_text_part(text: str = "") -> dict[str, Any]:
    return {"type": "output_text", "text": text}


def response_object(response_id: str, status: str, *, output: Sequence[Mapping[str, Any]] = (),
                    output_modalities: Sequence[str] = ("audio",), reason: str | None = None,
                    error: Mapping[str, str] | None = None, usage: ResponseUsage | None = None,
                    conversation_id: str | None = None, max_output_tokens: int | None = None,
                    metadata: Mapping[str, str] | None = None,
                    timings_ms: Mapping[str, float] | None = None) -> dict[str, Any]:
    """The ``realtime.response`` resource of ``response.created`` / ``response.done``."""
    if status not in RESPONSE_STATUSES:
        raise ValueError(f"response status must be one of {RESPONSE_STATUSES}, got {status!r}")
    if reason is not None and reason not in STATUS_REASONS.get(status, ()):
        raise ValueError(f"reason {reason!r} does not go with status {status!r}; allowed: {STATUS_REASONS}")
    if error is not None and status != "failed":
        raise ValueError("only a failed response carries an error")
    details: dict[str, Any] | None = None
    if status != "in_progress":
        details = {"type": status}
        if reason is not None:
            details["reason"] = reason
        if error is not None:
            details["error"] = dict(error)
    response: dict[str, Any] = {
        "id": response_id, "object": "realtime.response", "status": status, "status_details": details,
        "output": [dict(item) for item in output], "output_modalities": list(output_modalities),
        "conversation_id": conversation_id, "usage": None if usage is None else usage.to_dict(),
        "max_output_tokens": "inf" if max_output_tokens is None else max_output_tokens,
        "metadata": None if metadata is None else dict(metadata),
    }
    if timings_ms is not None:
        response[VENDOR_KEY] = {"timings_ms": {stage: float(ms) for stage, ms in timings_ms.items()}}
    return response


# ---- session and input buffer -------------------------------------------------------------------

def session_created(session: SessionConfig, vendor_info: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """``vendor_info``: what goes under the vendor key (``capabilities()``: what is served, the voices)."""
    info = capabilities() if vendor_info is None else dict(vendor_info)
    return server_event("session.created", session={**session.to_ga_dict(), VENDOR_KEY: info})


def session_updated(session: SessionConfig) -> dict[str, Any]:
    return server_event("session.updated", session=session.to_ga_dict())


def speech_started(audio_start_ms: int, item_id: str) -> dict[str, Any]:
    """``audio_start_ms`` counts from the session's first appended audio and includes the prefix padding."""
    return server_event("input_audio_buffer.speech_started", audio_start_ms=audio_start_ms, item_id=item_id)


def speech_stopped(audio_end_ms: int, item_id: str) -> dict[str, Any]:
    return server_event("input_audio_buffer.speech_stopped", audio_end_ms=audio_end_ms, item_id=item_id)


def input_audio_committed(item_id: str, previous_item_id: str | None) -> dict[str, Any]:
    return server_event("input_audio_buffer.committed", item_id=item_id, previous_item_id=previous_item_id)


def input_audio_cleared() -> dict[str, Any]:
    return server_event("input_audio_buffer.cleared")


def timeout_triggered(audio_start_ms: int, audio_end_ms: int, item_id: str) -> dict[str, Any]:
    return server_event("input_audio_buffer.timeout_triggered", audio_start_ms=audio_start_ms,
                  audio_end_ms=audio_end_ms, item_id=item_id)


# ---- conversation -------------------------------------------------------------------------------

def input_transcription_delta(item_id: str, delta: str) -> dict[str, Any]:
    return server_event("conversation.item.input_audio_transcription.delta", item_id=item_id, content_index=0,
                  delta=delta)


def input_transcription_completed(item_id: str, transcript: str, num_audio_ms: int) -> dict[str, Any]:
    # NOTE: `usage` is required by the GA schema; our recogniser is billed by nothing but time.
    return server_event("conversation.item.input_audio_transcription.completed", item_id=item_id, content_index=0,
                  transcript=transcript, usage={"type": "duration", "seconds": num_audio_ms / 1000.0})


def conversation_item_added(item: Mapping[str, Any], previous_item_id: str | None) -> dict[str, Any]:
    return server_event("conversation.item.added", item=dict(item), previous_item_id=previous_item_id)


def conversation_item_done(item: Mapping[str, Any], previous_item_id: str | None) -> dict[str, Any]:
    return server_event("conversation.item.done", item=dict(item), previous_item_id=previous_item_id)


def conversation_item_truncated(item_id: str, content_index: int, audio_end_ms: int) -> dict[str, Any]:
    return server_event("conversation.item.truncated", item_id=item_id, content_index=content_index,
                  audio_end_ms=audio_end_ms)


def conversation_item_deleted(item_id: str) -> dict[str, Any]:
    return server_event("conversation.item.deleted", item_id=item_id)


# ---- responses ----------------------------------------------------------------------------------

def response_created(response: Mapping[str, Any]) -> dict[str, Any]:
    return server_event("response.created", response=dict(response))


def response_done(response: Mapping[str, Any]) -> dict[str, Any]:
    if response.get("status") == "in_progress":
        raise ValueError("response.done needs a final status, not in_progress")
    return server_event("response.done", response=dict(response))


def output_item_added(response_id: str, output_index: int, item: Mapping[str, Any]) -> dict[str, Any]:
    return server_event("response.output_item.added", response_id=response_id, output_index=output_index,
                        item=dict(item))


def output_item_done(response_id: str, output_index: int, item: Mapping[str, Any]) -> dict[str, Any]:
    return server_event("response.output_item.done", response_id=response_id, output_index=output_index,
                        item=dict(item))


def _part_event(event_type: str, response_id: str, item_id: str, output_index: int, content_index: int,
                **fields: Any) -> dict[str, Any]:
    return server_event(event_type, response_id=response_id, item_id=item_id, output_index=output_index,
                  content_index=content_index, **fields)


def content_part_added(response_id: str, item_id: str, output_index: int, content_index: int, *,
                       is_audio: bool, text: str = "") -> dict[str, Any]:
    """The part starts empty; ``is_audio`` picks ``{"type": "audio", "transcript"}`` over ``{"type": "text"}``."""
    part = {"type": "audio", "transcript": text} if is_audio else {"type": "text", "text": text}
    return _part_event("response.content_part.added", response_id, item_id, output_index, content_index, part=part)


def content_part_done(response_id: str, item_id: str, output_index: int, content_index: int, *,
                      is_audio: bool, text: str) -> dict[str, Any]:
    part = {"type": "audio", "transcript": text} if is_audio else {"type": "text", "text": text}
    return _part_event("response.content_part.done", response_id, item_id, output_index, content_index, part=part)


def output_audio_delta(response_id: str, item_id: str, output_index: int, content_index: int,
                       audio: bytes) -> dict[str, Any]:
    return _part_event("response.output_audio.delta", response_id, item_id, output_index, content_index,
                       delta=b64encode(audio))


def output_audio_done(response_id: str, item_id: str, output_index: int, content_index: int) -> dict[str, Any]:
    return _part_event("response.output_audio.done", response_id, item_id, output_index, content_index)


def output_audio_transcript_delta(response_id: str, item_id: str, output_index: int, content_index: int,
                                  delta: str) -> dict[str, Any]:
    return _part_event("response.output_audio_transcript.delta", response_id, item_id, output_index,
                       content_index, delta=delta)


def output_audio_transcript_done(response_id: str, item_id: str, output_index: int, content_index: int,
                                 transcript: str) -> dict[str, Any]:
    return _part_event("response.output_audio_transcript.done", response_id, item_id, output_index,
                       content_index, transcript=transcript)


def output_text_delta(response_id: str, item_id: str, output_index: int, content_index: int,
                      delta: str) -> dict[str, Any]:
    return _part_event("response.output_text.delta", response_id, item_id, output_index, content_index, delta=delta)


def output_text_done(response_id: str, item_id: str, output_index: int, content_index: int,
                     text: str) -> dict[str, Any]:
    return _part_event("response.output_text.done", response_id, item_id, output_index, content_index, text=text)


def error_event(code: str, message: str, *, param: str | None = None, client_event_id: str | None = None,
                error_type: str = "invalid_request_error") -> dict[str, Any]:
    """OpenAI's ``error`` event; ``error.event_id`` names the client event at fault, if any."""
    return server_event("error", error={"type": error_type, "code": code, "message": message, "param": param,
                                  "event_id": client_event_id})

