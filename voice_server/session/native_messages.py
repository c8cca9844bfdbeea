"""The native protocol's messages (`WS /ws`, `voice_server/session/native.py`): the client's `session.start` read
into a session config (`read_start`), and each session event as the JSON the client gets (`to_json`).

Apart from the connection (the socket, the receive loop): these are the protocol's rules, which tests and the
fuzzer exercise without a socket.
"""

from __future__ import annotations

from typing import Any

from voice_server.audio.denoise import SuppressorUnavailable, check_available
from voice_server.config.voices import VoiceConfig
from voice_server.session.config import SessionConfig
from voice_server.session.events import (
    InputCommitted,
    InputTranscriptDelta,
    InputTranscriptDone,
    ItemTruncated,
    ResponseDone,
    ResponsePaused,
    ResponseResumed,
    ResponseStarted,
    SessionError,
    SessionEvent,
    SpeechStarted,
    SpeechStopped,
    TextDelta,
    ToolCalled,
)
from voice_server.session.realtime.adapt import tool_params
from voice_server.session.realtime.errors import FieldError
from voice_server.session.realtime.tool_fields import check_choice, parse_tool_choice, parse_tools
from voice_server.session.turn_config import TurnDetectionConfig
from voice_server.session.voices import check_unset, named_voice, with_voice

__all__ = ["SERVER_VAD_ONLY_KEYS", "read_start", "to_json"]

SERVER_VAD_ONLY_KEYS = ("threshold", "prefix_padding_ms", "silence_duration_ms", "idle_timeout_ms")


def read_start(message: Any, default_type: str = "server_vad", voices: tuple[VoiceConfig, ...] = (),
               default_voice: VoiceConfig | None = None) -> SessionConfig:
    """The `session.start` message -> the session's config; ValueError naming the field. A
    `turn_detection` without a `type` (or none at all) is of `default_type`, the pipeline's, unless it
    names `server_vad`'s own fields. `voices` and `default_voice`: the pipeline's (`named_voice`)."""
    if not isinstance(message, dict) or message.get("type") != "session.start":
        raise ValueError("the first message must be JSON {\"type\": \"session.start\", ...}")
    known = {"type", "input_rate", "output_rate", "instructions", "turn_detection", "params", "tools", "tool_choice",
             "voice", "noise_reduction"}
    unknown = sorted(str(k) for k in message if k not in known)
    if unknown:
        raise ValueError(f"session.start: unknown field(s) {', '.join(unknown)}")
    raw_turns = message.get("turn_detection", {})
    if isinstance(raw_turns, dict) and "type" not in raw_turns:
        # NOTE: server_vad's own fields without a type mean server_vad (what this protocol took before
        # semantic_vad existed); otherwise the pipeline's default.
        is_server = any(key in raw_turns for key in SERVER_VAD_ONLY_KEYS)
        raw_turns = {"type": "server_vad" if is_server else default_type, **raw_turns}
    turns = None if raw_turns is None else TurnDetectionConfig.from_openai(raw_turns)
    params = message.get("params", {})
    if not isinstance(params, dict):
        raise ValueError("params: must be an object")
    if "tools" in params or "tool_choice" in params:
        raise ValueError("params.tools: give tools and tool_choice in session.start itself (they are checked there)")
    try:
        tools = parse_tools(message.get("tools", []), "tools")
        choice = parse_tool_choice(message.get("tool_choice", "auto"), "tool_choice")
        check_choice(choice, tools, "tool_choice")
    except FieldError as exc:
        raise ValueError(f"{exc.param}: {exc.message}") from exc
    if tools:
        params = {**params, **tool_params(tools, choice)}
    _, voice = named_voice(message.get("voice"), voices, default_voice)
    if voice is not None:
        check_unset(params, voice, voices)  # NOTE: like tools: chosen by naming the voice, never set twice
        params = with_voice(params, voice)
    config = SessionConfig(input_rate=message.get("input_rate", 24000), output_rate=message.get("output_rate", 24000),
                           instructions=message.get("instructions", ""), turn_detection=turns,
                           params=tuple(params.items()), noise_reduction=message.get("noise_reduction"))
    if config.noise_reduction is not None:
        try:
            check_available()
        except SuppressorUnavailable as exc:
            raise ValueError(f"noise_reduction: {exc}") from exc
    return config


def to_json(event: SessionEvent) -> dict[str, Any]:
    if isinstance(event, SpeechStarted):
        return {"type": "speech_started", "item_id": event.item_id, "audio_start_ms": event.audio_start_ms}
    if isinstance(event, SpeechStopped):
        return {"type": "speech_stopped", "item_id": event.item_id, "audio_end_ms": event.audio_end_ms}
    if isinstance(event, InputCommitted):
        committed = {"type": "input_committed", "item_id": event.item_id, "audio_ms": event.num_audio_ms,
                     "text": event.text}
        if event.call_id:
            committed["call_id"] = event.call_id
        if event.num_images:
            committed["images"] = event.num_images
        return committed
    if isinstance(event, InputTranscriptDelta):
        return {"type": "input_transcript_delta", "item_id": event.item_id, "delta": event.delta}
    if isinstance(event, InputTranscriptDone):
        return {"type": "input_transcript_done", "item_id": event.item_id, "transcript": event.transcript}
    if isinstance(event, ResponseStarted):
        return {"type": "response_started", "response_id": event.response_id, "item_id": event.item_id}
    if isinstance(event, TextDelta):
        return {"type": "text_delta", "response_id": event.response_id, "delta": event.delta}
    if isinstance(event, ResponsePaused):
        return {"type": "response_paused", "response_id": event.response_id}
    if isinstance(event, ResponseResumed):
        return {"type": "response_resumed", "response_id": event.response_id}
    if isinstance(event, ResponseDone):
        return {"type": "response_done", "response_id": event.response_id, "item_id": event.item_id,
                "status": event.status, "text": event.text, "audio_ms": event.num_audio_ms,
                "timings_ms": event.timings_ms, "usage": event.usage, "error": event.error}
    if isinstance(event, ToolCalled):
        call = event.call
        return {"type": "tool_call", "response_id": event.response_id, "item_id": event.item_id,
                "call_id": call.call_id, "name": call.name, "arguments": call.arguments}
    if isinstance(event, ItemTruncated):
        return {"type": "item_truncated", "item_id": event.item_id, "audio_end_ms": event.audio_end_ms}
    assert isinstance(event, SessionError)
    return {"type": "error", "code": event.code, "message": event.message}
