"""`WS /twilio/media`: a phone call over Twilio Media Streams (a bidirectional `<Connect><Stream>`) as a `Session`.

Inbound frames go through `TwilioStreamGuard` (parse, order and identity checks; a fatal error closes
with its code: 1003, 1008 or 1009). The session starts at `start`: 8 kHz input (the caller's mu-law
decoded to PCM16), 8 kHz output (the Session resamples the pipeline's audio), the pipeline's turn detection
and default voice.

- Settings: `app.state.twilio` (`TwilioSettings`, in `settings`; absent: the defaults, no auth). With a
  `token`, `start` must carry it in `customParameters` (`is_authorized`), else the socket closes with 1008.
- Greeting: with `settings.greeting` (or `customParameters` `greeting`) the agent speaks first, a response
  made at `start` with those instructions added.
- Instructions: `settings.instructions`, unless `start.customParameters` has `instructions`: the TwiML
  that opens the stream is written by our own HTTP handler, so it may pick the prompt per call (e.g. per
  dialled number). NOTE: without a token anyone may connect and set it; it is only a prompt.
- Out: each `AudioDelta` -> `TwilioAudioEncoder` -> one `media` frame per 20 ms, each followed by a
  `mark` (`PlaybackTracker`); the encoder's tail goes out at `ResponseDone`. Each echoed mark moves the
  session's played position (`Session.on_playback`), so a barge-in keeps what the caller heard.
- Barge-in: `SpeechStarted` while a response runs or its audio still plays sends `clear` at once (from
  inside the session's event, before the session cancels the response) and writes off the unplayed
  audio (`PlaybackTracker.on_clear`). The Session then cuts the item to what the caller heard (the
  echoed marks it was given), also when generation had already finished (it runs faster than real
  time) and the audio was still playing at Twilio.
- Tools: a call with tools (`settings.tools` or `customParameters.tools`) has a webhook (`settings.webhook_of`):
  each `ToolCalled` is POSTed to it off the session loop, and the results are spoken (`call_tools.py`); a
  webhook that fails or times out makes the agent say `settings.tool_fallback`.
- `dtmf` is logged and given to `settings.listener`, which also sees every session event (transcripts,
  call analytics: Twilio has no text channel). `stop` or a dropped socket ends the session: the running
  response is aborted in every stage (`Session.close`).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging

from starlette.websockets import WebSocket, WebSocketDisconnect

from voice_server.session.connection import ConnectionGuard, ConnectionTracker, Engine, MetricsSource, SessionAdmission
from voice_server.session.core import Session
from voice_server.session.events import (
    AudioDelta,
    ResponseDone,
    ResponsePaused,
    ResponseResumed,
    ResponseStarted,
    SessionEvent,
    SpeechStarted,
)
from voice_server.session.pacing import Pacer
from voice_server.session.twilio.auth import is_authorized
from voice_server.session.twilio.call_tools import CallTools
from voice_server.session.twilio.inbound import TWILIO_SAMPLE_RATE
from voice_server.session.twilio.messages import (
    CLOSE_POLICY_VIOLATION,
    TwilioDtmf,
    TwilioMark,
    TwilioMedia,
    TwilioMessage,
    TwilioProtocolError,
    TwilioStart,
    TwilioStop,
)
from voice_server.session.twilio.outbound import (
    TwilioAudioEncoder,
    build_clear_message,
    build_mark_message,
    build_media_message,
)
from voice_server.session.twilio.playback import PlaybackTracker
from voice_server.session.twilio.settings import TwilioSettings
from voice_server.session.twilio.stream import TwilioStreamGuard

__all__ = ["twilio_ws"]

ENDPOINT = "twilio"
log = logging.getLogger(__name__)
START_TIMEOUT_S = 10.0
"""Twilio sends `connected` and `start` as soon as the socket opens; a socket without them is not Twilio."""
LEAD_S = 0.08
"""The most audio Twilio holds ahead (`Pacer`): less than a realtime client's (its media servers are on a data
centre's network), since on the phone band Silero hears a barge-in's "St" up to ~180 ms late."""


class TwilioConnection:
    """One Twilio stream: the guard's messages -> `Session`; its events -> frames (one sender at a time)."""

    def __init__(
        self, websocket: WebSocket, settings: TwilioSettings, guard: ConnectionGuard, metrics: ConnectionTracker,
    ) -> None:
        self.websocket, self.settings, self.gate_guard, self.metrics = websocket, settings, guard, metrics
        self.guard = TwilioStreamGuard()
        self.tracker = PlaybackTracker()
        self.encoder = TwilioAudioEncoder(TWILIO_SAMPLE_RATE)
        self.session: Session | None = None
        self.tools: CallTools | None = None
        self.is_open = True
        self.input_lock = asyncio.Lock()
        """Held while a message is fed to the session: a tool call's answer (`CallTools`) waits for it."""
        self._send_lock = asyncio.Lock()
        self._response_id: str | None = None
        """The response running in the session (between `ResponseStarted` and `ResponseDone`)."""
        self._cleared_response_id: str | None = None
        """A response whose audio was cleared: what it still emits before the cancel lands is dropped."""
        self.pacer: Pacer[str] = Pacer(self._send_one, LEAD_S)
        """The reply's media and marks, paced: Twilio plays what it has, so the server keeps its queue under
        `lead_s`; a held reply (`ResponsePaused`, tentative from the first speech window over it) goes quiet
        within that, and a clear drops what is here."""

    @property
    def stream_sid(self) -> str:
        sid = self.guard.stream_sid
        assert sid is not None, "no frame is sent before start"
        return sid

    async def serve(self, coordinator: Engine) -> None:
        try:
            async with asyncio.timeout(START_TIMEOUT_S):
                start = await self._receive_start()
        except TimeoutError:
            await self._close(CLOSE_POLICY_VIOLATION, "no start message")
            return
        if start is None:
            return
        if self.settings.token is not None and not is_authorized(start, self.settings.token):
            log.warning("twilio stream %s: closing (1008): not authorized", start.stream_sid)
            await self._close(CLOSE_POLICY_VIOLATION, "not authorized")
            return
        try:
            config, greeting, webhook = self.settings.open_call(start, coordinator.cfg)
        except ValueError as exc:
            await self._close(CLOSE_POLICY_VIOLATION, str(exc))
            return
        log.info("twilio stream %s: call %s started", start.stream_sid, start.call_sid)
        self.session = Session(coordinator, config, self.emit)
        self.tools = None if webhook is None else CallTools(webhook, start, self.session, self.input_lock, self.metrics)
        try:
            if greeting:
                # NOTE: the agent speaks first: a response on the empty conversation, with the call's
                # instructions and then the greeting's.
                await self.session.create_response(instructions="\n\n".join(filter(None, (
                    config.instructions, greeting))))
            await self._receive_loop(self.session)
        finally:
            # NOTE: nothing more is sent once the call is over (not even the aborted reply's tail).
            was_open, self.is_open = self.is_open, False
            if self.tools is not None:
                await self.tools.close()  # NOTE: first: a webhook's answer must not start a response now
            await self.session.close()
            await self.pacer.close()
            if was_open:  # NOTE: `stop`: a clean close; a dropped socket or a fatal frame closed already
                await self._close(1000, "stream stopped")
            log.info("twilio stream %s: ended", start.stream_sid)

    async def _receive_start(self) -> TwilioStart | None:
        """Frames up to `start` (`connected` before it is fine); None when the socket closed or was closed."""
        while True:
            message = await self._receive()
            if message is None:
                return None
            if isinstance(message, TwilioStart):
                return message

    async def _receive(self) -> TwilioMessage | None:
        """The next message the guard accepts; None when the socket ended (closed here on a fatal error)."""
        while True:
            try:
                frame = await self.gate_guard.receive()
            except WebSocketDisconnect:
                frame = {"type": "websocket.disconnect"}
            if frame["type"] == "websocket.disconnect":
                self.is_open = False
                return None
            raw = frame.get("text")
            message = self.guard.receive(raw if raw is not None else frame.get("bytes") or b"")
            if not isinstance(message, TwilioProtocolError):
                return message
            self.metrics.protocol_error(message.reason.split(":")[0][:40])
            if message.close_code is not None:
                await self._close(message.close_code, message.reason)
                return None

    async def _receive_loop(self, session: Session) -> None:
        while self.is_open:
            message = await self._receive()
            if message is None or isinstance(message, TwilioStop):
                return
            async with self.input_lock:
                if isinstance(message, TwilioMedia):
                    await session.on_audio(message.pcm16())
                    self.metrics.count_session(session)
                elif isinstance(message, TwilioMark):
                    # NOTE: only an echo that moved the played position can change what was heard.
                    if self.tracker.on_mark(message.name):
                        session.on_playback(int(self.tracker.audio_end_ms))
                elif isinstance(message, TwilioDtmf):
                    # NOTE: not the digit: callers key in PINs and card numbers; the listener gets it.
                    log.info("twilio stream %s: a key was pressed", self.stream_sid)
                    self._notify(message)

    # -- session events -> Twilio ----------------------------------------------------------------------

    async def emit(self, event: SessionEvent) -> None:
        # NOTE: the listener hears of an event once it has been handled (e.g. a reply's tail sent).
        try:
            await self._handle(event)
        finally:
            self._notify(event)
            self.metrics.observe(event)

    async def _handle(self, event: SessionEvent) -> None:
        if self.tools is not None:
            self.tools.on_event(event)
        if isinstance(event, SpeechStarted):
            await self._on_speech_started()
        elif isinstance(event, ResponsePaused):
            self.pacer.pause()
        elif isinstance(event, ResponseResumed):
            self.pacer.resume()
        elif isinstance(event, ResponseStarted):
            self._response_id = event.response_id
            self.tracker.start_response()
            self.encoder.reset()
            assert self.session is not None
            # NOTE: nothing has played yet; without a report the Session would count all audio sent as heard.
            self.session.on_playback(0)
        elif isinstance(event, AudioDelta):
            if event.response_id != self._cleared_response_id:
                await self._send_audio(self.encoder.encode(event.pcm16), is_last=False)
        elif isinstance(event, ResponseDone):
            self._response_id = None
            if event.response_id != self._cleared_response_id:
                await self._send_audio(self.encoder.flush(), is_last=True)

    async def _on_speech_started(self) -> None:
        session = self.session
        assert session is not None
        turns = session.config.turn_detection
        is_running = self._response_id is not None
        if turns is None or not turns.interrupt_response or not (is_running or self.tracker.queued_ms > 0):
            return
        # NOTE: before any await: the response may emit audio while the clear is being written.
        self._cleared_response_id = self._response_id
        self.encoder.reset()
        self.pacer.flush(lambda message: True)  # NOTE: media and marks not sent yet: never played
        self.tracker.on_clear()
        await self._send([build_clear_message(self.stream_sid)])

    async def _send_audio(self, frames: list[bytes], *, is_last: bool) -> None:
        for payload in frames:
            self.pacer.put(build_media_message(self.stream_sid, payload), len(payload) / TWILIO_SAMPLE_RATE)
            name = self.tracker.on_media_sent(len(payload))
            if name is not None:
                self.pacer.put(build_mark_message(self.stream_sid, name))
        if is_last and (name := self.tracker.mark_now()) is not None:
            self.pacer.put(build_mark_message(self.stream_sid, name))

    async def _send_one(self, message: str) -> None:
        await self._send([message])

    async def _send(self, messages: list[str]) -> None:
        if not self.is_open or not messages:
            return
        async with self._send_lock:
            for text in messages:
                if not await self.gate_guard.send_text(text):
                    self.is_open = False  # NOTE: the caller is gone (or was dropped); the receive loop ends the session
                    return

    def _notify(self, event: SessionEvent | TwilioDtmf) -> None:
        listener, start = self.settings.listener, self.guard.start
        if listener is None or start is None:
            return
        try:
            listener(start, event)
        except Exception:  # NOTE: an observer's bug must not end the call
            log.exception("twilio stream %s: the call listener failed", start.stream_sid)

    async def _close(self, code: int, reason: str) -> None:
        self.is_open = False
        await self.gate_guard.close(code, reason, label="protocol" if code != 1000 else "stop")


async def twilio_ws(websocket: WebSocket) -> None:
    state = websocket.app.state
    sessions: SessionAdmission = state.sessions
    metrics: MetricsSource = state.metrics
    settings = getattr(state, "twilio", None) or TwilioSettings()
    if settings.token is None and sessions.limits.auth_token is not None:
        # NOTE: the server's token protects calls too; Twilio carries it in `start.customParameters`.
        settings = dataclasses.replace(settings, token=sessions.limits.auth_token)
    # NOTE: no bearer check at the handshake: Twilio sends no header of ours; `start` is checked instead.
    guard = await sessions.admit(websocket, ENDPOINT, is_bearer_auth=False)
    if guard is None:
        return
    try:
        await TwilioConnection(websocket, settings, guard, metrics.track(ENDPOINT)).serve(state.coordinator)
    finally:
        await guard.release()

