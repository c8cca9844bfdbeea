"""In-process servers for session-layer tests: real stage processes running the stand-in speech stage
(`tests/speech_stages.py`), a real uvicorn `VoiceServer` on 127.0.0.1 on the coordinator's loop, and
helpers for real WebSocket clients and `GET /metrics`."""

from __future__ import annotations

import asyncio
import json
import time
import urllib.request
from typing import Any

import numpy as np
import uvicorn
from harness import Pipeline
from prometheus_client.parser import text_string_to_metric_families
from serving import free_port
from websockets.sync.client import ClientConnection, connect

from voice_server.audio import float32_to_pcm16, pcm16_to_bytes
from voice_server.config import pipeline_from_dict
from voice_server.server.app import VoiceServer, create_app
from voice_server.server.session_limits import SessionLimits

RATE = 16000
CHUNK_MS = 20


def speech_pipeline(step_delay_ms: int = 30, **fields: Any) -> Pipeline:
    return Pipeline(pipeline_from_dict({"name": "speech-test", **fields, "stages": [{
        "name": "speech", "factory": "speech_stages:create_fake_speech", "scheduler": "ar", "terminal": True,
        "max_batch_size": 8, "max_step_tokens": 64, "factory_args": {"step_delay_ms": step_delay_ms},
    }]}))


class LiveServer:
    """`create_app(pipeline.coordinator, limits)` served by a `VoiceServer` until `close()`."""

    def __init__(self, pipeline: Pipeline, limits: SessionLimits | None = None) -> None:
        self.pipeline, self.limits = pipeline, limits or SessionLimits()
        self.app = create_app(pipeline.coordinator, self.limits)
        self.port = free_port()
        config = uvicorn.Config(self.app, host="127.0.0.1", port=self.port, log_level="warning",
                                ws_max_size=self.limits.max_message_bytes, lifespan="off")
        self.server = VoiceServer(config)
        self.task = asyncio.run_coroutine_threadsafe(self.server.serve(), pipeline.lt.loop)
        deadline = time.monotonic() + 10
        while not self.server.started:
            assert time.monotonic() < deadline and not self.task.done(), "uvicorn did not start"
            time.sleep(0.02)

    @property
    def ws_url(self) -> str:
        return f"ws://127.0.0.1:{self.port}/ws"

    def metrics(self, is_served: bool = True) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
        """GET /metrics (or, once the server has stopped, the app's registry), parsed: (sample name,
        sorted labels) -> value."""
        if not is_served:
            text = self.app.state.metrics.render().decode()
        else:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/metrics", timeout=5) as resp:
                assert resp.status == 200 and resp.headers["content-type"].startswith("text/plain")
                text = resp.read().decode()
        return {(s.name, tuple(sorted(s.labels.items()))): s.value
                for family in text_string_to_metric_families(text) for s in family.samples}

    def close(self) -> None:
        self.server.should_exit = True
        self.task.result(15)


def metric(samples: dict[tuple[str, tuple[tuple[str, str], ...]], float], name: str, **labels: str) -> float:
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


def open_session(url: str, **start: Any) -> ClientConnection:
    ws = connect(url, open_timeout=5)
    ws.send(json.dumps({"type": "session.start", "input_rate": RATE, "output_rate": 24000,
                        "params": {"sampling": {"max_tokens": 12}}, **start}))
    assert json.loads(ws.recv(5))["type"] == "session.started"
    return ws


def stream_audio(ws: ClientConnection, signal: np.ndarray, pace: float = 1.0) -> None:
    """Send `signal` in 20 ms frames at `pace` x real time."""
    pcm = float32_to_pcm16(signal)
    step = RATE * CHUNK_MS // 1000
    start = time.monotonic()
    for i in range(0, len(pcm), step):
        ws.send(pcm16_to_bytes(pcm[i:i + step]))
        delay = start + (i + step) / RATE / pace - time.monotonic()
        if delay > 0:
            time.sleep(delay)


def events_until(ws: ClientConnection, kind: str, timeout: float = 10.0) -> tuple[list[dict[str, Any]], int]:
    """JSON events up to and including the first of `kind`, and the audio bytes received meanwhile
    (each event gets `audio_before`: the audio bytes received before it, and `at`: when it came)."""
    events, num_audio_bytes = [], 0
    deadline = time.monotonic() + timeout
    while True:
        message = ws.recv(max(0.01, deadline - time.monotonic()))
        if isinstance(message, bytes):
            num_audio_bytes += len(message)
            continue
        event = json.loads(message)
        events.append({**event, "audio_before": num_audio_bytes, "at": time.monotonic()})
        if event["type"] == kind:
            return events, num_audio_bytes
