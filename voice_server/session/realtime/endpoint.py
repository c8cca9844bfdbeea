"""`WS /v1/realtime`: the OpenAI Realtime protocol (GA) over a `Session`, so OpenAI's own clients (the
`openai` SDK's `client.realtime.connect`, browsers) hold a spoken conversation with this server.

The connection: `?model=...` is accepted and ignored (the server serves its one pipeline). Subprotocols:
browsers cannot set headers on a WebSocket, so OpenAI's browser clients offer `realtime`,
`openai-insecure-api-key.<key>` and `openai-beta.realtime-v1`; a browser fails the handshake unless
the server picks one of those it offered, so `realtime` is echoed when offered (else
`openai-beta.realtime-v1`); the key is never echoed. The SDK offers none and sends
`Authorization: Bearer <key>`.

On connect the server sends `session.created` with the default session (PCM 24 kHz in and out,
the pipeline's turn detection and default voice, audio output). Then every text frame is a client
event (`parse_client_event`); each is handled in order, one at a time, and what the session emits
meanwhile is sent by `Bridge` under one send lock. Every malformed or out-of-order event is answered
with an `error` event (codes in `errors`) and the session goes on; a binary frame is one of them
(`binary_frame`: the protocol layer's decision, so a client that sends raw audio learns why instead of
being cut off). A frame over the server's WebSocket size limit closes the connection with 1009
(uvicorn). Whenever the connection ends, the running response is aborted in every stage.

`adapt` maps the Realtime session onto the core's config and the audio formats; `handlers` does what
each client event asks of the session; `bridge` maps the session's events onto server events.

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
from collections.abc import Iterable

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
from voice_server.session.realtime.adapt import InputPace, core_config
from voice_server.session.realtime.bridge import Bridge, Event
from voice_server.session.realtime.capabilities import capabilities
from voice_server.session.realtime.errors import ProtocolError
from voice_server.session.realtime.events import parse_client_event
from voice_server.session.realtime.handlers import HANDLERS
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
        # NOTE: a new session's turn detection and voice are the pipeline's defaults (the client may change them).
        cfg = coordinator.cfg
        self.voices, default_voice = cfg.voices, cfg.default_voice_config
        config = DEFAULT_SESSION if cfg.turn_detection == "server_vad" else dataclasses.replace(
            DEFAULT_SESSION, turn_detection=ServerVad(type=cfg.turn_detection))
        self.config = config if default_voice is None else dataclasses.replace(config, voice=default_voice.name)
        self.takes_images = cfg.takes_images
        self.vendor_info = capabilities(self.voices, default_voice, self.takes_images)
        """What `session.created` says under the vendor key: what this server serves, and its voices."""
        self.session = Session(coordinator, core_config(self.config, self.voices), self.emit)
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
        await self.send(se.session_created(self.config, self.vendor_info))
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
            await HANDLERS[type(event)](self, event)
        finally:
            self.bridge.client_event_id = None


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

