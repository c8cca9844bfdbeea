"""Clients of `bench_turntaking.py`: one per session endpoint, each an open microphone and a player.

The microphone sends 20 ms frames at real-time pace (threads + `websockets.sync.client`): the user's
audio when an `Item` is said, a -60 dBFS room floor between (an open mic). What comes back goes to a
`Playout` (`turntaking_set.py`). The recorded `Track` (when each sent sample was spoken, when each
received sample was heard) is what the benchmark measures, offline.

Wire semantics, as each protocol's own clients behave:
- `/ws`, as the browser demo: flush at `response_done` `cancelled` and at `speech_started` over a reply
  (a confirmed turn); pause at `response_paused`, resume at `response_resumed` (of a reply not flushed);
  `playback` reports (`played_ms` of the current response) every ~100 ms;
- `/v1/realtime`: flush at `input_audio_buffer.speech_started` and `conversation.item.truncate` to what
  was heard (as OpenAI's clients do with `interrupt_response`);
- `/twilio/media`: flush at `clear` (every pending mark echoed at once, as Twilio does); a mark is
  echoed once the audio before it has been heard.
"""

from __future__ import annotations

import base64
import contextlib
import json
import threading
import time
import uuid
from collections import deque
from typing import Any

import numpy as np
import numpy.typing as npt
from turntaking_set import FLOOR_DB, FRAME_S, RATE, Item, Playout, Track, Utterance
from websockets.sync.client import connect

from voice_server.audio import (
    float32_to_pcm16,
    pcm16_from_bytes,
    pcm16_to_bytes,
    pcm16_to_float32,
    resample_signal,
    ulaw_decode,
    ulaw_encode,
)

REPORT_S = 0.1
"""How often `/ws` clients report what they played."""


class Client:
    """The protocol-independent half: mic, reader, player, the record."""

    endpoint, path, rate, out_rate = "", "", RATE, 24000
    floor_db = FLOOR_DB
    """The open microphone's level between utterances (white noise, dBFS)."""

    def __init__(self, port: int, seed: int = 0) -> None:
        self.url = f"ws://127.0.0.1:{port}{self.path}"
        self.playout = Playout(self.out_rate)
        self.lock = threading.RLock()
        self.statuses: dict[str, tuple[float, str]] = {}
        self.timings_ms: dict[str, dict[str, float]] = {}
        self.running: set[str] = set()
        self.current = ""
        """The response heard last (the one `playback` reports and truncations are about)."""
        self.utterances: list[Utterance] = []
        self.problems: list[str] = []
        self.last_audio_at = 0.0
        self.is_open = False
        self._frames: deque[tuple[npt.NDArray[np.int16], Utterance, int]] = deque()
        self._rng = np.random.default_rng(seed)
        self._send_lock = threading.Lock()
        self._threads: list[threading.Thread] = []

    # -- what a protocol implements -------------------------------------------------------------------

    def start(self) -> None:
        """Open the session (blocking until the server accepted it)."""

    def send_frame(self, pcm16: npt.NDArray[np.int16]) -> None:
        raise NotImplementedError

    def handle(self, message: str | bytes, now: float) -> None:
        raise NotImplementedError

    def tick(self, now: float) -> None:
        """Every 20 ms, from the mic (playback reports, mark echoes)."""

    def cut(self) -> bool:
        """Stop the running reply as a user would with a stop button (False: the protocol cannot)."""
        with self.lock:
            return self._cut(time.monotonic())

    def _cut(self, now: float) -> bool:
        return False

    @property
    def is_responding(self) -> bool:
        return bool(self.running)

    # -- the session -----------------------------------------------------------------------------------

    def __enter__(self) -> Client:
        self.ws = connect(self.url, open_timeout=20, max_size=None)
        self.start()
        self.is_open = True
        self._threads = [threading.Thread(target=f, daemon=True) for f in (self._read, self._mic)]
        for thread in self._threads:
            thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.is_open = False
        with contextlib.suppress(Exception):  # NOTE: the server may have closed it already
            self.ws.close()
        for thread in self._threads:
            thread.join(5)

    def send(self, message: str | bytes) -> None:
        with self._send_lock:
            self.ws.send(message)

    def say(self, item: Item, role: str) -> Utterance:
        """Queue `item`: the mic sends it from its next frame on."""
        utterance = Utterance(item, role)
        audio = item.audio if self.rate == RATE else resample_signal(item.audio, RATE, self.rate)
        pcm = float32_to_pcm16(audio)
        step = int(self.rate * FRAME_S)
        chunks = [pcm[i:i + step] for i in range(0, len(pcm), step)]
        with self.lock:
            self.on_say()
            self.utterances.append(utterance)
            self._frames.extend((chunk, utterance, len(chunks) - 1 - k) for k, chunk in enumerate(chunks))
        return utterance

    def on_say(self) -> None:
        """A new utterance starts (under the lock)."""

    def is_idle(self, now: float) -> bool:
        """Nothing running, nothing left to hear, nothing said."""
        with self.lock:
            return (not self._frames and not self.is_responding and self.playout.end + 0.2 <= now
                    and now - self.last_audio_at >= 0.5)

    def track(self) -> Track:
        with self.lock:
            return Track(self.endpoint, self.playout.heard(), list(self.playout.flushes), list(self.playout.pauses),
                         dict(self.statuses), list(self.utterances), list(self.problems), dict(self.timings_ms))

    def _mic(self) -> None:
        step = int(self.rate * FRAME_S)
        start, n = time.monotonic(), 0
        while self.is_open:
            with self.lock:
                frame, utterance, left = self._frames.popleft() if self._frames else (None, None, 0)
            if frame is None:
                noise = self._rng.standard_normal(step) * 10 ** (self.floor_db / 20)
                frame = float32_to_pcm16(noise.astype(np.float32))
            now = time.monotonic()
            try:
                self.send_frame(frame)
            except Exception as exc:  # NOTE: recorded; the driver sees `is_open` go False
                self._lost(exc)
                return
            if utterance is not None:
                utterance.send_times.append(now)
                if left == 0:
                    utterance.sent.set()
            with self.lock:
                self.tick(now)
            n += 1
            delay = start + n * FRAME_S - time.monotonic()
            if delay < -0.2:  # NOTE: this process fell behind (CPU): restart the clock, no burst of frames
                start, n, delay = time.monotonic(), 0, 0.0
            time.sleep(max(0.0, delay))

    def _read(self) -> None:
        try:
            for message in self.ws:
                now = time.monotonic()
                with self.lock:
                    self.handle(message, now)
        except Exception as exc:
            self._lost(exc)
        self._lost(None)

    def _lost(self, exc: BaseException | None) -> None:
        if self.is_open:
            self.problems.append(f"connection lost: {type(exc).__name__}: {exc}" if exc else "closed by the server")
            self.is_open = False
            for utterance in self.utterances:
                utterance.sent.set()  # NOTE: nothing more goes out: the driver must not wait for it

    def _audio(self, samples: npt.NDArray[np.float32], now: float, key: str) -> None:
        self.current, self.last_audio_at = key, now
        self.playout.add(samples, now, key)


class NativeClient(Client):
    endpoint, path = "ws", "/ws"

    def start(self) -> None:
        self.ws.send(json.dumps({"type": "session.start", "input_rate": self.rate, "output_rate": self.out_rate}))
        event = json.loads(self.ws.recv(20))
        if event.get("type") != "session.started":
            raise RuntimeError(f"session.start refused: {event}")
        self._key, self._reported, self._last_report = "", -1, 0.0
        self._flushed: set[str] = set()

    def send_frame(self, pcm16: npt.NDArray[np.int16]) -> None:
        self.send(pcm16_to_bytes(pcm16))

    def handle(self, message: str | bytes, now: float) -> None:
        if isinstance(message, bytes):
            self._audio(pcm16_to_float32(pcm16_from_bytes(message)), now, self._key)
            return
        event = json.loads(message)
        kind, key = event.get("type"), event.get("response_id", "")
        if kind == "response_started":
            if self.playout.paused_at is not None:
                self._flush(now)  # NOTE: a new reply: the paused one is over
            self._key, self._reported = key, -1
            self.running.add(key)
        elif kind == "response_done":
            self.running.discard(key)
            self.statuses[key] = (now, event.get("status", ""))
            self.timings_ms[key] = dict(event.get("timings_ms") or {})
            if event.get("status") == "cancelled":
                self._flush(now)
            elif event.get("status") != "completed":
                self.problems.append(f"response {event.get('status')}: {event.get('error', '')}")
        elif kind == "speech_started" and (self.running or self.playout.end > now):
            # NOTE: as the demo: a confirmed user turn over a reply that is still generating or playing. A
            # reply that finished generating gets no `response_done` then, only `item_truncated`.
            self._flush(now)
        elif kind == "response_paused" and key == self._key and key not in self._flushed:
            self.playout.pause(now, key)
        elif kind == "response_resumed" and key not in self._flushed:
            self.playout.resume(now)
        elif kind == "error":
            self.problems.append(f"error {event.get('code')}: {event.get('message')}")

    def tick(self, now: float) -> None:
        # NOTE: what was heard of the response the server runs (not of one before it), as the demo reports
        # it, from its first audio on: a barge-in keeps that much of it.
        if not self._key or now - self._last_report < REPORT_S:
            return
        played = int(1000 * self.playout.played_s(self._key, now))
        if played != self._reported and (played or self._reported >= 0):
            self.send(json.dumps({"type": "playback", "played_ms": played}))
            self._reported, self._last_report = played, now

    def _flush(self, now: float) -> None:
        self.playout.flush(now)
        self._flushed.update((self._key, self.current))

    def _cut(self, now: float) -> bool:
        if self.running:
            self.send(json.dumps({"type": "response.cancel"}))
        self._flush(now)
        return True


class RealtimeClient(Client):
    endpoint, path, rate = "realtime", "/v1/realtime?model=voice-server", 24000

    def start(self) -> None:
        event = json.loads(self.ws.recv(20))
        if event.get("type") != "session.created":
            raise RuntimeError(f"expected session.created: {event}")
        self._items: dict[str, str] = {}

    def send_frame(self, pcm16: npt.NDArray[np.int16]) -> None:
        self.send(json.dumps({"type": "input_audio_buffer.append",
                              "audio": base64.b64encode(pcm16_to_bytes(pcm16)).decode()}))

    def handle(self, message: str | bytes, now: float) -> None:
        event = json.loads(message)
        kind = event.get("type")
        if kind == "response.created":
            self.running.add(event["response"]["id"])
        elif kind == "response.output_audio.delta":
            self._items[event["response_id"]] = event["item_id"]
            pcm = pcm16_from_bytes(base64.b64decode(event["delta"]))
            self._audio(pcm16_to_float32(pcm), now, event["response_id"])
        elif kind == "response.done":
            response = event["response"]
            self.running.discard(response["id"])
            self.statuses[response["id"]] = (now, response.get("status", ""))
            if response.get("status") not in ("completed", "cancelled"):
                self.problems.append(f"response {response.get('status')}: {response.get('status_details')}")
        elif kind == "input_audio_buffer.speech_started" and self.playout.end > now:
            played_ms = int(1000 * self.playout.played_s(self.current, now))
            self.playout.flush(now)
            if self.current in self._items:
                self.send(json.dumps({"type": "conversation.item.truncate", "item_id": self._items[self.current],
                                      "content_index": 0, "audio_end_ms": played_ms}))
        elif kind == "error":
            error = event.get("error", {})
            self.problems.append(f"error {error.get('code')}: {error.get('message')}")

    def _cut(self, now: float) -> bool:
        if self.running:
            self.send(json.dumps({"type": "response.cancel"}))
        self.playout.flush(now)
        return True


class TwilioClient(Client):
    """A phone: 8 kHz mu-law. Twilio has no response events: a response is the audio from one `clear`
    or utterance to the next (`on_say`), and one runs while audio came within the last second."""

    endpoint, path, rate, out_rate = "twilio", "/twilio/media", 8000, 8000
    QUIET_S = 1.0

    def start(self) -> None:
        self._seq, self._marks, self._num_responses = 0, deque(), 0  # NOTE: _marks: (due, name)
        self.sid = "MZ" + uuid.uuid4().hex
        self.ws.send(json.dumps({"event": "connected", "protocol": "Call", "version": "1.0.0"}))
        self._send_event("start", start={
            "accountSid": "AC" + "0" * 32, "streamSid": self.sid, "callSid": "CA" + self.sid[2:],
            "tracks": ["inbound"], "customParameters": {},
            "mediaFormat": {"encoding": "audio/x-mulaw", "sampleRate": 8000, "channels": 1}})

    def _send_event(self, name: str, **body: Any) -> None:
        with self._send_lock:  # NOTE: the mic, the reader and the ticks all send: one sequence, in order
            self._seq += 1
            self.ws.send(json.dumps({"event": name, "sequenceNumber": str(self._seq), "streamSid": self.sid, **body}))

    def send_frame(self, pcm16: npt.NDArray[np.int16]) -> None:
        payload = base64.b64encode(ulaw_encode(pcm16).tobytes()).decode()
        self._send_event("media", media={"track": "inbound", "chunk": str(self._seq),
                                         "timestamp": str(self._seq * 20), "payload": payload})

    @property
    def is_responding(self) -> bool:
        return time.monotonic() - self.last_audio_at < self.QUIET_S

    def on_say(self) -> None:
        now = time.monotonic()
        if self.playout.end <= now and now - self.last_audio_at >= self.QUIET_S:
            self._num_responses += 1

    def handle(self, message: str | bytes, now: float) -> None:
        event = json.loads(message)
        kind = event.get("event")
        if kind == "media":
            codes = np.frombuffer(base64.b64decode(event["media"]["payload"]), np.uint8)
            self._audio(pcm16_to_float32(ulaw_decode(codes)), now, f"call-{self._num_responses}")
        elif kind == "mark":
            self._marks.append((max(now, self.playout.end), event["mark"]["name"]))
        elif kind == "clear":
            self.playout.flush(now)
            self._num_responses += 1
            while self._marks:  # NOTE: Twilio drops its buffer and echoes every pending mark at once
                self._send_event("mark", mark={"name": self._marks.popleft()[1]})
        else:
            self.problems.append(f"unexpected message: {kind}")

    def tick(self, now: float) -> None:
        while self._marks and self._marks[0][0] <= now:
            self._send_event("mark", mark={"name": self._marks.popleft()[1]})


CLIENTS: dict[str, type[Client]] = {"ws": NativeClient, "realtime": RealtimeClient, "twilio": TwilioClient}
