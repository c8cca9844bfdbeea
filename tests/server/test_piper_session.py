"""The opt-in Piper talker (the `piper` extra) behind a real server: a typed turn over `/ws` is echoed
by a scripted thinker (tests/text_stages.py) into the piper talker, whose 22.05 kHz speech the session
resamples to the client's rate; pocketsphinx reads it back as the reply's text at either rate."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

pytest.importorskip("piper", reason="the `piper` extra: pip install -e '.[dev,piper]'")

from harness import Pipeline  # noqa: E402
from session_server import SessionServer, serve  # noqa: E402
from speech_text import transcribe, word_error_rate  # noqa: E402
from websockets.sync.client import connect  # noqa: E402

from voice_server.audio import pcm16_from_bytes  # noqa: E402
from voice_server.config import pipeline_from_dict  # noqa: E402

# NOTE: a sentence pocketsphinx reads back clearly from this voice (tests/runners/test_tts_piper.py).
TEXT = "Good morning, I would like to book a table for two people tonight."


@pytest.fixture(scope="module")
def server() -> Iterator[SessionServer]:
    yield from serve(Pipeline(pipeline_from_dict({"name": "piper-session", "stages": [
        {"name": "thinker", "factory": "text_stages:create_scripted_text", "scheduler": "ar",
         "terminal": True, "stream_to": ["talker"], "memory_fraction": 0.01},
        {"name": "talker", "factory": "voice_server.stages.tts:create_tts", "terminal": True,
         "memory_fraction": 0.01, "max_batch_size": 1, "factory_args": {"engine": "piper"}},
    ]})), stage="thinker")


def reply(server: SessionServer, output_rate: int) -> tuple[dict[str, Any], bytes]:
    """One typed turn: the response_done event and the audio bytes that came before it."""
    ws = connect(f"ws://127.0.0.1:{server.port}/ws", open_timeout=5, max_size=None)
    ws.send(json.dumps({"type": "session.start", "input_rate": 16000, "output_rate": output_rate}))
    assert json.loads(ws.recv(5))["type"] == "session.started"
    ws.send(json.dumps({"type": "text", "text": TEXT}))
    audio, deadline = bytearray(), time.monotonic() + 30
    while True:
        message = ws.recv(max(0.01, deadline - time.monotonic()))
        if isinstance(message, bytes):
            audio += message
            continue
        event = json.loads(message)
        assert event["type"] != "error", event
        if event["type"] == "response_done":
            ws.close()
            return event, bytes(audio)


@pytest.mark.parametrize("output_rate", [24000, 16000])
def test_a_typed_turn_is_spoken_at_the_clients_rate(server: SessionServer, output_rate: int) -> None:
    done, audio = reply(server, output_rate)
    assert done["status"] == "completed" and done["text"].strip() == TEXT
    pcm = pcm16_from_bytes(audio).astype(np.float32) / 32768.0
    # NOTE: the duration says the rate was converted (not passed through as 22.05 kHz samples).
    assert abs(done["audio_ms"] - 1000 * pcm.size / output_rate) <= 50 and 2.0 < pcm.size / output_rate < 8.0
    assert word_error_rate(TEXT, transcribe(pcm, output_rate)) <= 0.35
    server.wait_idle(timeout=20)
