"""`WS /ws`: the native protocol (what the browser demo uses): binary PCM16 frames, JSON control.

1. The client's first message is JSON `{"type": "session.start", "input_rate": 16000,
   "output_rate": 24000, "instructions": "...", "turn_detection": {server_vad or semantic_vad fields} | null,
   "tools": [...], "tool_choice": "auto", "voice": "...", "params": {...}}` (every field optional; rates
   8000/16000/24000/48000, default 24000; `tools` and `tool_choice` as OpenAI Realtime's; `voice` one of the
   pipeline's voices or an OpenAI name it maps, default the pipeline's default voice (any name where the
   pipeline declares none); `params` go with every request, e.g. `{"sampling": {"max_tokens": 64}}`, and may
   not set what a voice sets; `noise_reduction` `near_field`, `far_field` (the same model, RNNoise, on the
   input before turn detection and recognition) or null, the default). The server answers `session.started`
   (`voice`, and `voices`: the pipeline's; `noise_reduction`; `images`: whether the pipeline sees).
2. Then binary frames are mono PCM16 little-endian audio at `input_rate`; text frames are JSON:
   `input.commit`, `input.clear` (manual turns), `text` `{"text", "respond": true}`, `response.create`,
   `response.cancel`, `playback` `{"played_ms"}` (how much of the current response the client has
   played: a barge-in keeps exactly that much in the conversation), `tool_result` `{"call_id", "output",
   "respond": true}` (a tool call's output; `respond` starts the next response), `image` `{"image": a PNG or
   JPEG data URL (or its base64), "text": "", "respond": false}` (a user item with the image, where the
   pipeline sees: else an `unsupported` error; by default no response: the user asks about it next).
3. The server sends JSON events `speech_started`, `speech_stopped`, `input_committed`,
   `input_transcript_delta` (`item_id`, `delta`) and `input_transcript_done` (`item_id`, `transcript`)
   where the pipeline transcribes the user, `response_started`, `text_delta`, `tool_call` (`response_id`,
   `item_id`, `call_id`, `name`, `arguments`: a checked call; the client runs it), `response_done`
   (`status`, `text`, `audio_ms`, `timings_ms`, `usage`), `item_truncated`, `error` (`code`, `message`), and
   binary frames of PCM16 at `output_rate`: the audio of the response between its `response_started`
   and `response_done`.

Errors: a first message that is not a valid `session.start` closes with 1008 (with the reason); a
bad message afterwards gets an `error` event and the session goes on; frames over the server's size
limit close with 1009 (uvicorn). Whenever the connection ends the running response is aborted in
every stage.

Admission, limits and metrics are the app's (`app.state.sessions` and `.metrics`, seen here as the Protocols
of `voice_server/session/connection.py`; the server's `SessionGate` and `Metrics` implement them): auth and
origin refusals close 1008, a pipeline not ready or `max_sessions` reached closes 1013, idle sessions close
1000, a client that stops reading is dropped, shutdown closes 1001.
"""

from __future__ import annotations

import asyncio
import json
import logging
from typing import Any

import numpy as np
from starlette.websockets import WebSocket, WebSocketDisconnect

from voice_server.audio import pcm16_from_bytes, pcm16_to_bytes
from voice_server.session.connection import ConnectionGuard, ConnectionTracker, Engine, MetricsSource, SessionAdmission
from voice_server.session.conversation import Item, new_id
from voice_server.session.core import Session
from voice_server.session.events import (
    AudioDelta,
    ResponseDone,
    ResponsePaused,
    ResponseResumed,
    SessionError,
    SessionEvent,
)
from voice_server.session.images import check_image, parse_data_url
from voice_server.session.native_messages import read_start, to_json
from voice_server.session.tools import ToolCall
from voice_server.session.voices import named_voice

log = logging.getLogger(__name__)
START_TIMEOUT_S = 10.0
CLOSE_POLICY = 1008
ENDPOINT = "native"


class NativeConnection:
    """One `/ws` connection: receive loop -> `Session`, its events -> the socket (one sender at a time)."""

    def __init__(self, websocket: WebSocket, guard: ConnectionGuard, metrics: ConnectionTracker) -> None:
        self.websocket, self.guard, self.metrics = websocket, guard, metrics
        self._send_lock = asyncio.Lock()
        self.is_open = True

    async def emit(self, event: SessionEvent) -> None:
        if isinstance(event, ResponsePaused | ResponseResumed) and event.is_tentative:
            return  # NOTE: this client pauses its own playback: a tentative hold would stutter it (events.py)
        if not self.is_open:
            if isinstance(event, ResponseDone):
                self.metrics.observe(event)  # NOTE: a response the disconnect cancelled still counts
            return
        async with self._send_lock:
            if isinstance(event, AudioDelta):
                is_sent = await self.guard.send_bytes(pcm16_to_bytes(event.pcm16))
            else:
                is_sent = await self.guard.send_text(json.dumps(to_json(event)))
        self.metrics.observe(event)
        if not is_sent:
            self.is_open = False  # NOTE: the client is gone (or was dropped); the receive loop ends the session

    async def error(self, code: str, message: str) -> None:
        await self.emit(SessionError(code, message))

    async def serve(self, coordinator: Engine) -> None:
        try:
            async with asyncio.timeout(START_TIMEOUT_S):
                first = await self.guard.receive()
            if first["type"] == "websocket.disconnect":
                return
            cfg = coordinator.cfg
            message = json.loads(first.get("text") or "null")
            config = read_start(message, cfg.turn_detection, cfg.voices, cfg.default_voice_config)
            voice, _ = named_voice(message.get("voice"), cfg.voices, cfg.default_voice_config)
        # NOTE: RecursionError: json.loads of deeply nested text ("[[[[...") exhausts the recursion limit.
        except (TimeoutError, ValueError, TypeError, RecursionError) as exc:
            self.metrics.protocol_error("invalid_session_start")
            await self.guard.close(CLOSE_POLICY, str(exc)[:120], label="invalid_session_start")
            return
        session = Session(coordinator, config, self.emit)
        await self.guard.send_text(json.dumps({
            "type": "session.started", "input_rate": config.input_rate, "output_rate": config.output_rate,
            "turn_detection": None if config.turn_detection is None else config.turn_detection.type,
            "voice": voice, "voices": [v.name for v in cfg.voices], "noise_reduction": config.noise_reduction,
            "images": cfg.takes_images}))
        try:
            while self.is_open:
                message = await self.guard.receive()
                if message["type"] == "websocket.disconnect":
                    break
                if message.get("bytes") is not None:
                    await self._on_audio(session, message["bytes"])
                elif message.get("text") is not None:
                    await self._on_control(session, message["text"])
        except WebSocketDisconnect:
            pass
        finally:
            self.is_open = False
            await session.close()

    async def _on_audio(self, session: Session, data: bytes) -> None:
        try:
            pcm = pcm16_from_bytes(data)
        except ValueError as exc:
            await self.error("invalid_audio", str(exc))
            return
        await session.on_audio(np.ascontiguousarray(pcm))
        self.metrics.count_session(session)

    async def _on_control(self, session: Session, text: str) -> None:
        try:
            message = json.loads(text)
        except (ValueError, RecursionError):  # NOTE: RecursionError: "[[[[..." nested past the limit
            await self.error("invalid_json", "a text frame must be a JSON object")
            return
        kind = message.get("type") if isinstance(message, dict) else None
        if kind == "input.commit":
            await session.commit()
        elif kind == "input.clear":
            await session.clear()
        elif kind == "text":
            body = message.get("text")
            if not isinstance(body, str) or not body:
                await self.error("invalid_value", "text: must be a non-empty string")
                return
            await session.add_text(body)
            if message.get("respond", True):
                self.metrics.turn_ended()
                await session.create_response()
        elif kind == "tool_result":
            await self._on_tool_result(session, message)
        elif kind == "image":
            await self._on_image(session, message)
        elif kind == "response.create":
            self.metrics.turn_ended()
            await session.create_response()
        elif kind == "response.cancel":
            if not await session.cancel_response():
                await self.error("no_response", "no response is running")
        elif kind == "playback":
            played = message.get("played_ms")
            if isinstance(played, bool) or not isinstance(played, int) or played < 0:
                await self.error("invalid_value", "played_ms: must be an integer >= 0")
                return
            session.on_playback(played)
        else:
            await self.error("unknown_event", f"unknown message type {kind!r}")

    async def _on_image(self, session: Session, message: dict[str, Any]) -> None:
        if not session.coordinator.cfg.takes_images:
            await self.error("unsupported", "image: this pipeline does not see (its entry stage runs no vision "
                                            "encoder)")
            return
        text, raw = message.get("text", ""), message.get("image")
        if not isinstance(text, str) or not isinstance(raw, str):
            await self.error("invalid_value", "image: needs image (a PNG or JPEG data URL, or its base64) and text "
                                              "(a string, may be empty)")
            return
        try:
            data = parse_data_url(raw if raw.startswith("data:") else f"data:image/png;base64,{raw}")
            check_image(data)
        except ValueError as exc:
            await self.error("invalid_value", f"image: {exc}")
            return
        await session.add_item(Item(new_id("item"), "user", text, images=(data,)))
        if message.get("respond", False):
            self.metrics.turn_ended()
            await session.create_response()

    async def _on_tool_result(self, session: Session, message: dict[str, Any]) -> None:
        call_id, output = message.get("call_id"), message.get("output")
        if not isinstance(call_id, str) or not call_id or not isinstance(output, str):
            await self.error("invalid_value", "tool_result: needs call_id (a non-empty string) and output (a string)")
            return
        if not any(item.call is not None and item.call.call_id == call_id and item.kind == "function_call"
                   for item in session.conversation.items):
            await self.error("invalid_value", f"tool_result: no tool call {call_id!r} in the conversation")
            return
        await session.add_item(Item(new_id("item"), "tool", output, kind="function_call_output",
                                    call=ToolCall(call_id, "", "")))
        if message.get("respond", True):
            self.metrics.turn_ended()
            await session.create_response()


async def native_ws(websocket: WebSocket) -> None:
    state = websocket.app.state
    sessions: SessionAdmission = state.sessions
    metrics: MetricsSource = state.metrics
    guard = await sessions.admit(websocket, ENDPOINT)
    if guard is None:
        return  # NOTE: refused (auth, origin, not ready, full, shutting down): closed and counted
    try:
        await NativeConnection(websocket, guard, metrics.track(ENDPOINT)).serve(state.coordinator)
    finally:
        await guard.release()
