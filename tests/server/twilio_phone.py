"""`Phone`: a scripted Twilio Media Streams client, standing in for Twilio's media server and the caller.

It speaks the wire format Twilio does (counters as decimal strings, `customParameters`, 20 ms mu-law
frames every 20 ms of real time) and plays what the server sends as a phone would: the received audio
is queued and plays in real time, a mark is echoed when the audio queued before it has played, and a
`clear` drops the queued audio and echoes every pending mark at once (as Twilio does; those echoes
are not counted as played here either). `Calls` is the call listener the tests give the server.
"""

from __future__ import annotations

import json
import time
from collections import defaultdict, deque
from typing import Any

import numpy as np
from speech_text import ulaw_of
from websockets.exceptions import ConnectionClosed
from websockets.sync.client import connect

from voice_server.audio import b64decode, b64encode
from voice_server.session.events import ResponseDone
from voice_server.session.twilio import TwilioStart

RATE = 8000
FRAME = 160  # NOTE: 20 ms of 8 kHz mu-law, what Twilio sends per media message
FRAME_S = 0.02


class Phone:
    def __init__(self, port: int, name: str = "1") -> None:
        self.ws = connect(f"ws://127.0.0.1:{port}/twilio/media", open_timeout=5)
        self.stream_sid, self.call_sid, self.account_sid = f"MZ{name:0>32}", f"CA{name:0>32}", f"AC{name:0>32}"
        self.seq = 0
        self.num_chunks = 0
        self.started_at = time.monotonic()
        self.media: list[tuple[float, bytes]] = []
        """(arrival time, mu-law payload) of every media message, cleared ones included."""
        self.marks: list[str] = []
        self.clears: list[tuple[float, int]] = []
        """(arrival time, samples echoed as played by then) of every clear."""
        self.num_received_samples = 0
        self.num_played_samples = 0
        """Position of the newest mark echoed because its audio played (cleared echoes excluded)."""
        self.play_end = 0.0
        self._pending: deque[tuple[float, str, int]] = deque()  # (due, name, position)
        self.close_code: int | None = None

    # -- what the caller's side sends --------------------------------------------------------------

    def send(self, event: str, **body: Any) -> None:
        self.seq += 1
        self.ws.send(json.dumps({"event": event, "sequenceNumber": str(self.seq), "streamSid": self.stream_sid,
                                 **body}))

    def start(self, encoding: str = "audio/x-mulaw", **custom_parameters: str) -> None:
        self.ws.send(json.dumps({"event": "connected", "protocol": "Call", "version": "1.0.0"}))
        self.send("start", start={
            "accountSid": self.account_sid, "streamSid": self.stream_sid, "callSid": self.call_sid,
            "tracks": ["inbound"], "customParameters": custom_parameters,
            "mediaFormat": {"encoding": encoding, "sampleRate": 8000, "channels": 1}})

    def stop(self) -> None:
        self.send("stop", stop={"accountSid": self.account_sid, "callSid": self.call_sid})

    def talk(self, ulaw: bytes, until: Any = None, timeout_s: float = 15.0) -> float:
        """Stream `ulaw` in 20 ms frames at real-time pace, then the line's silence (the -60 dBFS floor)
        until `until()` is true (or at once without it); returns when the first frame was sent."""
        floor = ulaw_of((0.001 * np.random.default_rng(7).standard_normal(16000 * 2)).astype(np.float32))
        first_at = time.monotonic()
        deadline = first_at + timeout_s
        i = 0
        while True:
            if i >= len(ulaw) and (until is None or until()):
                return first_at
            assert time.monotonic() < deadline, "talk: timed out"
            k = i // FRAME * FRAME % len(floor)
            frame = ulaw[i:i + FRAME] if i < len(ulaw) else floor[k:k + FRAME]
            self.num_chunks += 1
            self.send("media", media={"track": "inbound", "chunk": str(self.num_chunks),
                                      "timestamp": str(self.num_chunks * 20), "payload": b64encode(frame)})
            i += FRAME
            self.pump(first_at + i / RATE)

    # -- what the phone does with the server's frames -----------------------------------------------

    def pump(self, until: float) -> None:
        """Take the server's frames and echo the marks that are due, until the monotonic time `until`."""
        while True:
            self._echo_due()
            left = until - time.monotonic()
            if left <= 0:
                return
            try:
                message = self.ws.recv(max(0.001, min(left, self._next_due() - time.monotonic())))
            except TimeoutError:
                continue
            self._on_message(json.loads(message))

    def closed_with(self, timeout_s: float = 5.0) -> int | None:
        """The close code the server sends (frames before it are taken as usual)."""
        deadline = time.monotonic() + timeout_s
        try:
            while time.monotonic() < deadline:
                self.pump(time.monotonic() + 0.05)
        except ConnectionClosed as exc:
            return None if exc.rcvd is None else exc.rcvd.code
        raise AssertionError("the server did not close the socket")

    @property
    def is_playing(self) -> bool:
        """Whether audio is queued whose marks have not been echoed yet."""
        return bool(self._pending)

    @property
    def played_ms(self) -> float:
        return self.num_played_samples / 8

    def _next_due(self) -> float:
        return self._pending[0][0] if self._pending else float("inf")

    def _on_message(self, message: dict[str, Any]) -> None:
        now = time.monotonic()
        assert message["streamSid"] == self.stream_sid, message
        if message["event"] == "media":
            payload = b64decode(message["media"]["payload"])
            self.media.append((now, payload))
            self.num_received_samples += len(payload)
            self.play_end = max(now, self.play_end) + len(payload) / RATE
        elif message["event"] == "mark":
            self.marks.append(message["mark"]["name"])
            self._pending.append((self.play_end, message["mark"]["name"], self.num_received_samples))
        elif message["event"] == "clear":
            self.clears.append((now, self.num_played_samples))
            self.play_end = now
            while self._pending:
                self._echo(self._pending.popleft()[1])
        else:
            raise AssertionError(f"unexpected message {message}")

    def _echo_due(self) -> None:
        while self._pending and self._pending[0][0] <= time.monotonic():
            _, name, position = self._pending.popleft()
            self.num_played_samples = position
            self._echo(name)

    def _echo(self, name: str) -> None:
        self.send("mark", mark={"name": name})


class Calls:
    """The call listener: every event of every call, with the time it happened, by call sid."""

    def __init__(self) -> None:
        self.events: dict[str, list[tuple[float, Any]]] = defaultdict(list)

    def __call__(self, start: TwilioStart, event: Any) -> None:
        self.events[start.call_sid].append((time.monotonic(), event))

    def of(self, phone: Phone, kind: type) -> list[tuple[float, Any]]:
        return [(at, e) for at, e in list(self.events[phone.call_sid]) if isinstance(e, kind)]

    def done(self, phone: Phone) -> list[ResponseDone]:
        return [e for _, e in self.of(phone, ResponseDone)]
