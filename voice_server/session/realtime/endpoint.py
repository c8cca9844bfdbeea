"""`WS /v1/realtime`: the OpenAI Realtime protocol (GA) over a `Session`, so OpenAI's own clients (the
`openai` SDK's `client.realtime.connect`, browsers) hold a spoken conversation with this server.

The connection: `?model=...` is accepted and ignored (the server serves its one pipeline). Subprotocols:
browsers cannot set headers on a WebSocket, so OpenAI's browser clients offer `realtime`,
`openai-insecure-api-key.<key>` and `openai-beta.realtime-v1`; a browser fails the handshake unless
the server picks one of those it offered, so `realtime` is echoed when offered (else
`openai-beta.realtime-v1`); the key is never echoed. The SDK offers none and sends
`Authorization: Bearer <key>`.

On connect the server sends `session.created` with the default session (PCM 24 kHz in and out,
`server_vad`, audio output). Then every text frame is a client event (`parse_client_event`); each is
handled in order, one at a time, and what the session emits meanwhile is sent by `Bridge` under one
send lock. Every malformed or out-of-order event is answered with an `error` event (codes in
`errors`) and the session goes on; a binary frame is one of them (`binary_frame`: the protocol layer's
decision, so a client that sends raw audio learns why instead of being cut off). A frame over the
server's WebSocket size limit closes the connection with 1009 (uvicorn). Whenever the connection ends,
the running response is aborted in every stage.

`adapt` maps the Realtime session onto the core's config and the audio formats; `bridge` maps the
session's events onto server events.

Output pacing: what the session emits goes out through a `Pacer`, in order, its audio in pieces of
`PIECE_S`, the client holding at most `lead_s` of it; OpenAI's clients cannot pause, so this is what lets
a reply held at speech over it (`ResponsePaused`, tentative from its first window) go quiet within `lead_s`,
and a confirmed interruption
(`speech_started`) drop the rest of its audio here rather than in the client.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
from collections.abc import Awaitable, Callable, Iterable
from typing import Any

from starlette.websockets import WebSocket, WebSocketDisconnect

from voice_server.session.connection import ConnectionGuard, ConnectionTracker, Engine, MetricsSource, SessionAdmission
from voice_server.session.core import Session
from voice_server.session.events import (
    AudioDelta,
    ResponsePaused,
    ResponseResumed,
    ResponseStarted,
    SessionEvent,
    SpeechStarted,
)
from voice_server.session.pacing import Pacer
from voice_server.session.realtime import server_events as se
from voice_server.session.realtime.adapt import MAX_INPUT_PACE, InputPace, core_config, decode_input, sampling_params
from voice_server.session.realtime.bridge import Bridge, Event
from voice_server.session.realtime.errors import (
    ACTIVE_RESPONSE,
    CANCEL_NOT_ACTIVE,
    INPUT_AUDIO_TOO_FAST,
    INVALID_VALUE,
    UNSUPPORTED,
    FieldError,
    ProtocolError,
)
from voice_server.session.realtime.events import (
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
from voice_server.session.realtime.session_config import DEFAULT_SESSION
from voice_server.session.realtime.session_fields import ServerVad

SUBPROTOCOLS = ("realtime", "openai-beta.realtime-v1")
"""Offered subprotocols the server may pick, in order of preference (never the one carrying a key)."""
ENDPOINT = "realtime"


def choose_subprotocol(offered: Iterable[str]) -> str | None:
    names = list(offered)
    return next((name for name in SUBPROTOCOLS if name in names), None)


PIECE_S = 0.04
"""Audio deltas are cut to this length, so that pacing (and a flush) works at this grain."""
AUDIO_DELTA = "response.output_audio.delta"


def _is_audio_delta(event: Event) -> bool:
    return event.get("type") == AUDIO_DELTA


def _pieces(event: SessionEvent, rate: int) -> list[SessionEvent]:
    """An audio delta cut into `PIECE_S` pieces (the session sends a clause, seconds of audio, at once)."""
    if not isinstance(event, AudioDelta):
        return [event]
    pcm, step = event.pcm16, max(1, int(PIECE_S * rate))
    return [AudioDelta(event.response_id, event.item_id, pcm[i:i + step]) for i in range(0, pcm.size, step)]


class RealtimeConnection:
    """One `/v1/realtime` connection: client events -> `Session`, its events -> the socket via `Bridge`."""

    def __init__(
        self, websocket: WebSocket, coordinator: Engine, guard: ConnectionGuard, metrics: ConnectionTracker,
    ) -> None:
        self.websocket, self.guard, self.metrics = websocket, guard, metrics
        # NOTE: a new session's turn detection is the pipeline's default (the client may change it).
        kind = coordinator.cfg.turn_detection
        self.config = DEFAULT_SESSION if kind == "server_vad" else dataclasses.replace(
            DEFAULT_SESSION, turn_detection=ServerVad(type=kind))
        self.session = Session(coordinator, core_config(self.config), self.emit)
        self.bridge = Bridge(self.session.conversation, self.config)
        self.pace = InputPace()
        self._send_lock = asyncio.Lock()
        self.is_open = True
        self.pacer: Pacer[Event] = Pacer(self._send_paced)

    async def emit(self, event: SessionEvent) -> None:
        # NOTE: translated under the lock, so the bridge's state changes in the order the client sees it.
        async with self._send_lock:
            if isinstance(event, ResponsePaused):
                self.pacer.pause()
            elif isinstance(event, ResponseResumed):
                self.pacer.resume()
            elif isinstance(event, SpeechStarted | ResponseStarted):
                # NOTE: a turn over a reply, or the next reply: what is not sent of the last one is never heard
                # (the session thinks it played on arrival, so speech over its paced tail is not an interruption).
                self.pacer.flush(_is_audio_delta)
            rate = self.session.config.output_rate
            for piece in _pieces(event, rate):
                duration_s = piece.pcm16.size / rate if isinstance(piece, AudioDelta) else 0.0
                for wire in self.bridge.events(piece):
                    self.pacer.put(wire, duration_s if _is_audio_delta(wire) else 0.0)
        self.metrics.observe(event)

    async def _send_paced(self, event: Event) -> None:
        await self._send_all((event,))

    async def send(self, *events: Event) -> None:
        async with self._send_lock:
            await self._send_all(events)

    async def _send_all(self, events: Iterable[Event]) -> None:
        for event in events:
            if not self.is_open:
                return
            if event.get("type") == "error":
                self.metrics.protocol_error(str(event.get("error", {}).get("code", "error")))
            if not await self.guard.send_text(json.dumps(event)):
                self.is_open = False  # NOTE: the client is gone (or was dropped); the receive loop ends the session

    async def error(self, code: str, message: str, param: str | None = None) -> None:
        await self.send(ProtocolError(code, message, param, self.bridge.client_event_id).to_event())

    async def serve(self) -> None:
        self.pace = InputPace()  # NOTE: the pace counts from the moment the client can send
        await self.send(se.session_created(self.config))
        try:
            while self.is_open:
                message = await self.guard.receive()
                if message["type"] == "websocket.disconnect":
                    break
                frame = message.get("text")
                await self.on_frame((message.get("bytes") or b"") if frame is None else frame)
        except WebSocketDisconnect:
            pass
        finally:
            self.is_open = False
            await self.session.close()
            await self.pacer.close()

    async def on_frame(self, frame: str | bytes) -> None:
        event = parse_client_event(frame)
        if isinstance(event, ProtocolError):
            await self.send(event.to_event())
            return
        self.bridge.client_event_id = event.event_id
        try:
            await _HANDLERS[type(event)](self, event)
        finally:
            self.bridge.client_event_id = None

    # -- handlers ----------------------------------------------------------------------------------------

    async def on_session_update(self, event: SessionUpdate) -> None:
        try:
            config = self.config.updated(event.patch)
            core = core_config(config)
        except FieldError as exc:
            await self.send(exc.to_protocol_error(event.event_id).to_event())
            return
        except ValueError as exc:
            await self.error(INVALID_VALUE, str(exc), "session.audio.input.turn_detection")
            return
        await self.session.reconfigure(core)
        self.config = self.bridge.session = config
        await self.send(se.session_updated(config))

    async def on_append(self, event: InputAudioBufferAppend) -> None:
        fmt = self.config.input_format
        try:
            pcm = decode_input(event.audio, fmt)
        except ValueError as exc:
            await self.error(INVALID_VALUE, f"Invalid 'audio' for {fmt.type}: {exc}.", "audio")
            return
        num_ms = 1000.0 * pcm.size / fmt.rate_hz
        if not self.pace.admit(num_ms):
            await self.error(INPUT_AUDIO_TOO_FAST, f"Audio is arriving faster than {MAX_INPUT_PACE:g}x real time; "
                                                   f"this append ({num_ms:.0f} ms) was dropped. Send audio as it "
                                                   "is captured.", "audio")
            return
        if pcm.size:
            await self.session.on_audio(pcm)
            self.metrics.count_session(self.session)

    async def on_commit(self, event: InputAudioBufferCommit) -> None:
        await self.session.commit()  # NOTE: an empty buffer is the session's error event

    async def on_clear(self, event: InputAudioBufferClear) -> None:
        await self.session.clear()
        await self.send(se.input_audio_cleared())

    async def on_item_create(self, event: ConversationItemCreate) -> None:
        items = self.session.conversation.items
        previous = event.previous_item_id
        if previous is not None and previous != (items[-1].item_id if items else "root"):
            if self.session.conversation.get(previous) is None and previous != "root":
                await self.error(INVALID_VALUE, f"No item with id '{previous}'.", "previous_item_id")
            else:
                await self.error(UNSUPPORTED, "Items are added at the end of the conversation only: "
                                              "previous_item_id must be the last item's id.", "previous_item_id")
            return
        try:
            await self.session.add_text(event.item.text, event.item.role, event.item.item_id)
        except ValueError:
            await self.error(INVALID_VALUE, f"An item with id '{event.item.item_id}' exists already.", "item.id")

    async def on_truncate(self, event: ConversationItemTruncate) -> None:
        item = self.session.conversation.get(event.item_id)
        if item is None or item.role != "assistant":
            await self.error(INVALID_VALUE, f"No assistant item with id '{event.item_id}'.", "item_id")
            return
        if event.content_index != 0:
            await self.error(INVALID_VALUE, "Assistant items have one content part: content_index must be 0.",
                             "content_index")
            return
        await self._stop_response_of(item.item_id)
        if event.audio_end_ms > item.num_audio_ms:
            await self.error(INVALID_VALUE, f"Audio content of {item.num_audio_ms}ms is already shorter than "
                                            f"{event.audio_end_ms}ms.", "audio_end_ms")
            return
        await self.session.truncate(item.item_id, event.audio_end_ms)

    async def on_delete(self, event: ConversationItemDelete) -> None:
        await self._stop_response_of(event.item_id)
        if not self.session.conversation.delete(event.item_id):
            await self.error(INVALID_VALUE, f"No item with id '{event.item_id}'.", "item_id")
            return
        await self.send(se.conversation_item_deleted(event.item_id))

    async def _stop_response_of(self, item_id: str) -> None:
        """The client truncates or deletes the item a response is still writing: it has stopped listening
        to that response, so the response stops (as `response.cancel` would) before the item changes."""
        run = self.bridge.active
        if run is not None and run.item_id == item_id:
            run.cancel_reason = "client_cancelled"
            await self.session.cancel_response()

    async def on_response_create(self, event: ResponseCreate) -> None:
        overrides = event.response
        self.metrics.turn_ended()
        if self.session.is_responding():
            await self.error(ACTIVE_RESPONSE, "Conversation already has an active response in progress.")
            return
        if overrides.is_out_of_band:
            await self.error(UNSUPPORTED, "Responses outside the conversation are not supported.",
                             "response.conversation")
            return
        if overrides.output_format is not None and overrides.output_format != self.config.output_format:
            await self.error(UNSUPPORTED, "A response's output format must be the session's; change it with "
                                          "session.update.", "response.audio.output.format")
            return
        base = dict(dict(self.session.config.params).get("sampling", {}))
        if overrides.max_output_tokens == "inf":
            base.pop("max_tokens", None)
        max_tokens = overrides.max_output_tokens if isinstance(overrides.max_output_tokens, int) else None
        sampling = sampling_params(max_tokens, overrides.temperature, base)
        self.bridge.overrides = overrides
        await self.session.create_response({"sampling": sampling} if sampling else None, overrides.instructions)

    async def on_response_cancel(self, event: ResponseCancel) -> None:
        run = self.bridge.active
        if run is None or event.response_id not in (None, run.response_id):
            await self.error(CANCEL_NOT_ACTIVE, "There is no active response to cancel"
                             + (f" with id '{event.response_id}'." if event.response_id else "."), "response_id")
            return
        run.cancel_reason = "client_cancelled"
        await self.session.cancel_response()


_HANDLERS: dict[type, Callable[[RealtimeConnection, Any], Awaitable[None]]] = {
    SessionUpdate: RealtimeConnection.on_session_update,
    InputAudioBufferAppend: RealtimeConnection.on_append,
    InputAudioBufferCommit: RealtimeConnection.on_commit,
    InputAudioBufferClear: RealtimeConnection.on_clear,
    ConversationItemCreate: RealtimeConnection.on_item_create,
    ConversationItemTruncate: RealtimeConnection.on_truncate,
    ConversationItemDelete: RealtimeConnection.on_delete,
    ResponseCreate: RealtimeConnection.on_response_create,
    ResponseCancel: RealtimeConnection.on_response_cancel,
}


async def realtime_ws(websocket: WebSocket) -> None:
    # NOTE: auth (`Authorization: Bearer` or the browsers' `openai-insecure-api-key.<key>` subprotocol),
    # origin, readiness and the session limit are the gate's (`app.state.sessions`, a `SessionAdmission`).
    state = websocket.app.state
    sessions: SessionAdmission = state.sessions
    metrics: MetricsSource = state.metrics
    subprotocol = choose_subprotocol(websocket.scope.get("subprotocols", ()))
    guard = await sessions.admit(websocket, ENDPOINT, subprotocol=subprotocol)
    if guard is None:
        return
    try:
        await RealtimeConnection(websocket, state.coordinator, guard, metrics.track(ENDPOINT)).serve()
    finally:
        await guard.release()

