"""`RealtimeClient`: a raw `websockets` client of `WS /v1/realtime` for the endpoint tests.

A reader thread stamps each server event with its arrival time (`_at`), so a test measures latencies
as the client sees them even while it is busy streaming audio; every event is checked against the
`openai` SDK's server-event models as it is taken.
"""

from __future__ import annotations

import asyncio
import json
import queue
import threading
import time
from typing import Any

import numpy as np
import pydantic
from openai.types.realtime import RealtimeServerEvent
from websockets.exceptions import ConnectionClosed
from websockets.sync.client import connect

from voice_server.audio import b64decode, b64encode, float32_to_pcm16, pcm16_to_bytes, ulaw_encode

SERVER_EVENTS: pydantic.TypeAdapter[Any] = pydantic.TypeAdapter(RealtimeServerEvent)
CHUNK_MS = 20


def encode(signal: np.ndarray, fmt: str = "audio/pcm") -> bytes:
    """float32 audio at the format's rate -> the bytes of an append."""
    pcm = float32_to_pcm16(signal)
    return ulaw_encode(pcm).tobytes() if fmt == "audio/pcmu" else pcm16_to_bytes(pcm)


def text_item(text: str, role: str = "user") -> dict[str, Any]:
    return {"type": "message", "role": role, "content": [{"type": "input_text", "text": text}]}


class RealtimeClient:
    def __init__(self, port: int, subprotocols: list[str] | None = None) -> None:
        self.ws = connect(f"ws://127.0.0.1:{port}/v1/realtime?model=anything", open_timeout=5,
                          subprotocols=subprotocols)  # type: ignore[arg-type]
        self.events: queue.Queue[dict[str, Any] | None] = queue.Queue()
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()
        self.session = self.until("session.created")[-1]["session"]

    def _read(self) -> None:
        try:
            for message in self.ws:
                self.events.put({**json.loads(message), "_at": time.monotonic()})
        except ConnectionClosed:
            pass
        finally:
            self.events.put(None)

    def send(self, event_type: str, **fields: Any) -> None:
        self.ws.send(json.dumps({"type": event_type, **fields}))

    def next(self, timeout: float = 10.0) -> dict[str, Any]:
        event = self.events.get(timeout=timeout)
        assert event is not None, "the server closed the connection"
        model = SERVER_EVENTS.validate_python({k: v for k, v in event.items() if k != "_at"})
        assert model.type == event["type"]
        return event

    def until(self, kind: str, timeout: float = 10.0) -> list[dict[str, Any]]:
        """Events up to and including the first of `kind`."""
        deadline = time.monotonic() + timeout
        events: list[dict[str, Any]] = []
        while not events or events[-1]["type"] != kind:
            events.append(self.next(max(0.01, deadline - time.monotonic())))
        return events

    def update(self, **session: Any) -> dict[str, Any]:
        self.send("session.update", session={"type": "realtime", **session})
        return self.until("session.updated")[-1]["session"]

    def stream(self, audio: bytes, bytes_per_ms: int, pace: float = 1.0) -> None:
        """Append `audio` in 20 ms chunks at `pace` x real time."""
        step = bytes_per_ms * CHUNK_MS
        start = time.monotonic()
        for i in range(0, len(audio), step):
            self.send("input_audio_buffer.append", audio=b64encode(audio[i:i + step]))
            delay = start + (i + step) / bytes_per_ms / 1000 / pace - time.monotonic()
            if delay > 0:
                time.sleep(delay)

    def close(self) -> None:
        self.ws.close()


def audio_bytes(events: list[dict[str, Any]]) -> int:
    return sum(len(b64decode(e["delta"])) for e in events if e["type"] == "response.output_audio.delta")


def transcript(events: list[dict[str, Any]]) -> str:
    return "".join(e["delta"] for e in events if e["type"] in ("response.output_audio_transcript.delta",
                                                                "response.output_text.delta"))


def without_deltas(events: list[dict[str, Any]]) -> list[str]:
    return [e["type"] for e in events if not e["type"].endswith(".delta")]


async def sdk_events(conn: Any, timeout_s: float = 60.0, stop_at_refusal: bool = False) -> list[Any]:
    """Every server event of an `openai` SDK realtime connection up to `response.done` (with `stop_at_refusal`,
    also up to an `error` that came before any `response.created`: a refused `response.create`), each also
    validated strictly: the SDK builds its models without validating."""
    events: list[Any] = []
    async with asyncio.timeout(timeout_s):
        async for event in conn:
            wire = event.to_dict()
            assert SERVER_EVENTS.validate_python(wire).type == event.type, wire
            events.append(event)
            is_refused = stop_at_refusal and event.type == "error" and not any(
                e.type == "response.created" for e in events)
            if event.type == "response.done" or is_refused:
                return events
    raise AssertionError("the connection closed before response.done")
