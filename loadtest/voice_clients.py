"""WebSocket voice clients for the locust load test, one per session endpoint, on `websocket-client`.

NOTE: why `websocket-client`: locust runs every user as a gevent greenlet and monkey-patches the socket
module; websocket-client is plain blocking sockets, so under the patch its `recv` yields to the other
greenlets and one process holds many sessions. websockets' sync client runs its own background thread
and selector per connection, which under gevent's patched threading becomes a greenlet racing the
caller's and stalls (and its asyncio client would need a loop per user).

A client holds one session: `mic` frames go out every 20 ms of real time from a sender greenlet (speech
when the user speaks, a -60 dBFS floor otherwise, as from an open microphone), a receive greenlet turns
the server's messages into `Reply` records (arrival and length of each audio chunk, the end, the status)
and `problems` (protocol error events, failed responses, closes).
"""

from __future__ import annotations

import base64
import contextlib
import json
import time
import uuid
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import gevent
import numpy as np
import websocket

from voice_server.audio import PlayoutClock, pcm16_from_bytes, ulaw_decode, ulaw_encode

FRAME_S = 0.02


@dataclass
class Reply:
    """One response as the client heard it."""

    started: float
    item_id: str = ""
    chunks: list[tuple[float, float]] = field(default_factory=list)
    """(arrival, seconds of audio) of each audio message."""
    done: float | None = None
    status: str = ""
    stopped: float | None = None
    """When the server stopped this reply because the user spoke over it (cancel, truncation, clear)."""
    heard: PlayoutClock = field(default_factory=lambda: PlayoutClock(8000))
    """When the first audible frame of it is heard (its rate set by the client at the first chunk)."""

    def hear(self, pcm16: np.ndarray, rate: int, now: float) -> None:
        """An audio chunk arrived: the playout clock finds the first audible frame (-40 dBFS)."""
        if self.heard.first_byte_at is None:
            self.heard = PlayoutClock(rate)
        self.heard.sent(pcm16, now)

    def player(self) -> tuple[float, float]:
        """A player that starts at the first byte and plays at 1x real time: (seconds it starved waiting
        for audio after it started, when it finishes playing what arrived)."""
        starved, end = 0.0, 0.0
        for i, (at, seconds) in enumerate(self.chunks):
            if i and at > end:
                starved += at - end
            end = max(end, at) + seconds
        return starved, end

    @property
    def audio_s(self) -> float:
        return sum(s for _, s in self.chunks)


class VoiceClient:
    """The protocol-independent half: the mic's pacing, replies, problems."""

    path = ""
    rate = 16000

    def __init__(self, base_url: str, params: dict[str, Any]) -> None:
        url = base_url.replace("https://", "wss://").replace("http://", "ws://").rstrip("/")
        self.ws = websocket.create_connection(url + self.path, timeout=30, enable_multithread=True)
        self.params = params
        self.replies: list[Reply] = []
        self.problems: deque[str] = deque()
        self.is_open = True
        self._speech: deque[bytes] = deque()
        self._spoke_at: float | None = None
        rng = np.random.default_rng(7)
        self._floor = self.encode((0.001 * 32767 * rng.standard_normal(self.frame_samples)).astype(np.int16))
        self.start()
        self.ws.settimeout(None)  # NOTE: a session may be quiet for long (a slow reply): only closes end it
        self._greenlets = [gevent.spawn(self._receive), gevent.spawn(self._mic)]

    @property
    def frame_samples(self) -> int:
        return int(self.rate * FRAME_S)

    # -- what a protocol implements -----------------------------------------------------------------

    def start(self) -> None:
        """Open the session (blocking until the server accepted it)."""

    def encode(self, pcm16: np.ndarray) -> bytes:
        return pcm16.astype("<i2").tobytes()

    def send_frame(self, frame: bytes) -> None:
        raise NotImplementedError

    def handle(self, message: str | bytes, now: float) -> None:
        raise NotImplementedError

    def tick(self, now: float) -> None:
        """Called by the mic every 20 ms (playback reports, mark echoes)."""

    # -- the user's side -----------------------------------------------------------------------------

    def say(self, pcm16: np.ndarray) -> None:
        """Queue speech; the mic sends it from its next frame on (`speaking`, `spoke_at`)."""
        step = self.frame_samples
        self._spoke_at = None
        self._speech.extend(self.encode(pcm16[i:i + step]) for i in range(0, len(pcm16), step))

    @property
    def speaking(self) -> bool:
        return bool(self._speech)

    @property
    def spoke_at(self) -> float | None:
        """When the last frame of the last `say` went out."""
        return self._spoke_at

    @property
    def current(self) -> Reply | None:
        return self.replies[-1] if self.replies else None

    def close(self) -> None:
        self.is_open = False
        gevent.killall(self._greenlets, block=False)
        with contextlib.suppress(Exception):  # NOTE: closing a socket the server already closed
            self.ws.close(timeout=1)

    def _mic(self) -> None:
        start, n = time.monotonic(), 0
        while self.is_open:
            frame = self._speech.popleft() if self._speech else self._floor
            try:
                self.send_frame(frame)
            except Exception as exc:
                self._closed(exc)
                return
            now = time.monotonic()
            if not self._speech and self._spoke_at is None:
                self._spoke_at = now
            self.tick(now)
            n += 1
            delay = start + n * FRAME_S - now
            if delay < -0.2:  # NOTE: this process fell behind (CPU): restart the clock, no burst of frames
                start, n, delay = now, 0, 0.0
            gevent.sleep(max(0.0, delay))

    def _receive(self) -> None:
        while self.is_open:
            try:
                opcode, data = self.ws.recv_data()
            except Exception as exc:
                self._closed(exc)
                return
            if opcode == websocket.ABNF.OPCODE_CLOSE:
                self._closed(RuntimeError(f"closed by the server: {data[:2].hex()} {data[2:]!r}"))
                return
            message = data.decode() if opcode == websocket.ABNF.OPCODE_TEXT else data
            self.handle(message, time.monotonic())

    def _closed(self, exc: BaseException) -> None:
        if self.is_open:
            self.problems.append(f"connection lost: {type(exc).__name__}: {exc}")
            self.is_open = False

    def _new_reply(self, now: float, item_id: str = "") -> Reply:
        reply = Reply(now, item_id)
        self.replies.append(reply)
        return reply


class NativeClient(VoiceClient):
    """`WS /ws`: PCM16 at 16 kHz in binary frames, replies at 24 kHz, `playback` reports every 250 ms."""

    path, rate, out_rate = "/ws", 16000, 24000

    def start(self) -> None:
        self.ws.send(json.dumps({"type": "session.start", "input_rate": self.rate, "output_rate": self.out_rate,
                                 "params": self.params}))
        event = json.loads(self.ws.recv())
        if event.get("type") != "session.started":
            raise RuntimeError(f"session.start refused: {event}")
        self._reported = 0.0

    def send_frame(self, frame: bytes) -> None:
        self.ws.send_binary(frame)

    def tick(self, now: float) -> None:
        reply = self.current
        if reply is None or not reply.chunks or reply.stopped or now - self._reported < 0.25:
            return
        _, end = reply.player()
        if now < end + 0.25:
            played = min(reply.audio_s, now - reply.chunks[0][0])
            self.ws.send(json.dumps({"type": "playback", "played_ms": int(1000 * played)}))
            self._reported = now

    def handle(self, message: str | bytes, now: float) -> None:
        reply = self.current
        if isinstance(message, bytes):
            if reply is not None and reply.done is None:
                reply.chunks.append((now, len(message) / 2 / self.out_rate))
                reply.hear(pcm16_from_bytes(message), self.out_rate, now)
            return
        event = json.loads(message)
        kind = event.get("type")
        if kind == "response_started":
            self._new_reply(now, event.get("item_id", ""))
        elif kind == "response_done" and reply is not None:
            reply.done, reply.status = now, event.get("status", "")
            if reply.status == "cancelled":
                reply.stopped = reply.stopped or now
            elif reply.status != "completed":
                self.problems.append(f"response {reply.status}: {event.get('error', '')}")
        elif kind == "item_truncated" and reply is not None and event.get("item_id") == reply.item_id:
            reply.stopped = reply.stopped or now
        elif kind == "error":
            self.problems.append(f"error event: {event.get('code')}: {event.get('message')}")


class RealtimeClient(VoiceClient):
    """`WS /v1/realtime`: base64 PCM16 at 24 kHz in and out (the session's default `audio/pcm`)."""

    path, rate = "/v1/realtime?model=voice-server", 24000

    def start(self) -> None:
        event = json.loads(self.ws.recv())
        if event.get("type") != "session.created":
            raise RuntimeError(f"expected session.created: {event}")
        tokens = self.params.get("sampling", {}).get("max_tokens")
        if tokens:
            self.ws.send(json.dumps({"type": "session.update", "session": {"type": "realtime",
                                                                           "max_output_tokens": tokens}}))

    def send_frame(self, frame: bytes) -> None:
        self.ws.send(json.dumps({"type": "input_audio_buffer.append", "audio": base64.b64encode(frame).decode()}))

    def handle(self, message: str | bytes, now: float) -> None:
        reply = self.current
        event = json.loads(message)
        kind = event.get("type")
        if kind == "response.created":
            self._new_reply(now)
        elif kind == "response.output_item.added" and reply is not None:
            reply.item_id = event.get("item", {}).get("id", "")
        elif kind == "response.output_audio.delta" and reply is not None and reply.done is None:
            pcm = base64.b64decode(event["delta"])
            reply.chunks.append((now, len(pcm) / 2 / self.rate))
            reply.hear(pcm16_from_bytes(pcm), self.rate, now)
        elif kind == "response.done" and reply is not None:
            response = event.get("response", {})
            reply.done, reply.status = now, response.get("status", "")
            if reply.status == "cancelled":
                reply.stopped = reply.stopped or now
            elif reply.status != "completed":
                self.problems.append(f"response {reply.status}: {response.get('status_details')}")
        elif kind == "input_audio_buffer.speech_started" and reply is not None and reply.chunks and not reply.stopped:
            # NOTE: as OpenAI's clients do: the server cannot know what played of a reply that finished
            # generating, so the client cuts it to what it played when the user speaks over it.
            played = min(reply.audio_s, now - reply.chunks[0][0])
            if played < reply.audio_s and reply.item_id:
                self.ws.send(json.dumps({"type": "conversation.item.truncate", "item_id": reply.item_id,
                                         "content_index": 0, "audio_end_ms": int(1000 * played)}))
        elif kind == "conversation.item.truncated" and reply is not None and event.get("item_id") == reply.item_id:
            reply.stopped = reply.stopped or now
        elif kind == "error":
            error = event.get("error", {})
            self.problems.append(f"error event: {error.get('code')}: {error.get('message')}")


class TwilioClient(VoiceClient):
    """`WS /twilio/media`: 8 kHz mu-law media every 20 ms; replies are the server's media frames, played
    at real time by the simulated phone, which echoes each mark once the audio before it has played (as
    Twilio does). Twilio has no end-of-response event: a reply ends once its audio has played and no
    more came for `QUIET_S` (`settle`); its end time is then its last audio's arrival."""

    path, rate = "/twilio/media", 8000
    QUIET_S = 1.0

    def start(self) -> None:
        self._seq, self._pending = 0, deque()  # (due, mark name)
        self.sid = "MZ" + uuid.uuid4().hex
        self.ws.send(json.dumps({"event": "connected", "protocol": "Call", "version": "1.0.0"}))
        self._send("start", start={"accountSid": "AC" + "0" * 32, "streamSid": self.sid, "callSid": "CA" + self.sid[2:],
                                   "tracks": ["inbound"], "customParameters": {},
                                   "mediaFormat": {"encoding": "audio/x-mulaw", "sampleRate": 8000, "channels": 1}})

    def encode(self, pcm16: np.ndarray) -> bytes:
        return bytes(ulaw_encode(pcm16.astype(np.int16)).tobytes())

    def _send(self, event: str, **body: Any) -> None:
        self._seq += 1
        self.ws.send(json.dumps({"event": event, "sequenceNumber": str(self._seq), "streamSid": self.sid, **body}))

    def send_frame(self, frame: bytes) -> None:
        self._send("media", media={"track": "inbound", "chunk": str(self._seq), "timestamp": str(self._seq * 20),
                                   "payload": base64.b64encode(frame).decode()})

    def tick(self, now: float) -> None:
        while self._pending and self._pending[0][0] <= now:
            self._send("mark", mark={"name": self._pending.popleft()[1]})

    def settle(self, now: float) -> None:
        reply = self.current
        if reply is None or reply.done is not None or not reply.chunks:
            return
        last = reply.chunks[-1][0]
        if now >= reply.player()[1] and now - last >= self.QUIET_S:
            reply.done, reply.status = last, "completed"

    def handle(self, message: str | bytes, now: float) -> None:
        event = json.loads(message)
        kind = event.get("event")
        self.settle(now)
        reply = self.current
        if kind == "media":
            if reply is None or reply.done is not None:
                reply = self._new_reply(now)
            payload = base64.b64decode(event["media"]["payload"])
            reply.chunks.append((now, len(payload) / self.rate))
            reply.hear(ulaw_decode(np.frombuffer(payload, np.uint8)), self.rate, now)
        elif kind == "mark":
            end = reply.player()[1] if reply is not None and reply.done is None else now
            self._pending.append((end, event["mark"]["name"]))
        elif kind == "clear":
            if reply is not None and reply.done is None:
                reply.done, reply.status, reply.stopped = now, "cancelled", now
            while self._pending:  # NOTE: Twilio drops its buffer and echoes every pending mark at once
                self._send("mark", mark={"name": self._pending.popleft()[1]})
        else:
            self.problems.append(f"unexpected message: {kind}")


CLIENTS: dict[str, type[VoiceClient]] = {"ws": NativeClient, "realtime": RealtimeClient, "twilio": TwilioClient}
