"""Noise reduction of the input (`audio.input.noise_reduction` on `/v1/realtime`, `noise_reduction` on `/ws`)
end to end: a real server over the stand-in speech stage, which reports the RMS level of the last spoken
turn it was sent (`l<dBFS>`, `tests/speech_stages.py`). White noise alone reaches the pipeline more than
20 dB quieter with it (the model's first moments, while it learns the noise, included) and as it was
without it; a voice still opens and ends a turn through it, at about its level."""

from __future__ import annotations

import json

import numpy as np
import pytest
from live_server import RATE as WS_RATE
from live_server import events_until, stream_audio
from live_server import open_session as live_open_session
from realtime_client import RealtimeClient, encode, transcript
from session_server import SessionServer
from speech_signals import signal_of
from websockets.exceptions import ConnectionClosed
from websockets.sync.client import connect

RATE = 24000
PCM_BYTES_PER_MS = RATE // 1000 * 2
NOISE_DBFS = -30.0
AT_16K_DB = 10 * np.log10(0.95 * 16000 / 24000)
"""White noise at 24 kHz loses the band above 16 kHz's Nyquist (the resampler's passband ends at 0.95 of it)."""


def white_noise(rate: int, num_ms: int) -> np.ndarray:
    return (np.random.default_rng(7).standard_normal(rate * num_ms // 1000) * 10 ** (NOISE_DBFS / 20)).astype(
        np.float32)


def level_heard(text: str) -> float:
    """The level word of the stand-in's reply: the last spoken turn's RMS level in dBFS."""
    word = next(word for word in text.split() if word.startswith("l"))
    return -200.0 if word == "lnone" else float(word[1:])


def realtime_noise_turn(server: SessionServer, noise_reduction: dict[str, str] | None) -> float:
    client = RealtimeClient(server.port)
    served = client.session["x_voice_server"]["served"]
    assert any(name.startswith("session.audio.input.noise_reduction") for name in served)
    session = client.update(max_output_tokens=4, audio={"input": {"turn_detection": None,
                                                                 "noise_reduction": noise_reduction}})
    assert session["audio"]["input"]["noise_reduction"] == noise_reduction
    client.stream(encode(white_noise(RATE, 1500)), PCM_BYTES_PER_MS, pace=1.8)
    client.send("input_audio_buffer.commit")
    client.until("input_audio_buffer.committed")
    client.send("response.create")
    level = level_heard(transcript(client.until("response.done")))
    client.close()
    return level


def test_realtime_noise_alone_reaches_the_pipeline_far_quieter_with_noise_reduction(server: SessionServer) -> None:
    assert abs(realtime_noise_turn(server, None) - (NOISE_DBFS + AT_16K_DB)) <= 1.0
    for kind in ("near_field", "far_field"):
        assert realtime_noise_turn(server, {"type": kind}) < NOISE_DBFS - 20


def test_realtime_a_voice_still_makes_a_turn_through_noise_reduction(server: SessionServer) -> None:
    client = RealtimeClient(server.port)
    client.update(max_output_tokens=4, audio={"input": {"noise_reduction": {"type": "near_field"}}})
    voice = signal_of(RATE, ("noise", 300), ("voice", 900), ("noise", 700))
    client.stream(encode(voice), PCM_BYTES_PER_MS, pace=1.8)
    events = client.until("response.done")
    kinds = [event["type"] for event in events]
    assert kinds[:2] == ["input_audio_buffer.speech_started", "input_audio_buffer.speech_stopped"], kinds
    started, stopped = events[:2]
    assert 0 <= started["audio_start_ms"] < 600 < stopped["audio_end_ms"] <= 1900
    voice_db = 10 * np.log10(np.mean(np.square(voice[int(0.3 * RATE):int(1.2 * RATE)], dtype=np.float64)))
    # NOTE: the turn holds some quiet around the voice too, which pulls its level down a little.
    assert voice_db - 6 < level_heard(transcript(events)) <= voice_db + 1
    client.send("session.update", session={"type": "realtime", "audio": {"input": {"noise_reduction": {
        "type": "loud"}}}})
    error = client.until("error")[-1]["error"]
    assert error["code"] == "invalid_value" and error["param"] == "session.audio.input.noise_reduction.type"
    client.close()


def test_ws_session_start_takes_noise_reduction(server: SessionServer) -> None:
    url = f"ws://127.0.0.1:{server.port}/ws"
    levels = {}
    for kind in (None, "far_field"):
        ws = live_open_session(url, turn_detection=None, noise_reduction=kind)
        stream_audio(ws, white_noise(WS_RATE, 1500), pace=4.0)
        ws.send(json.dumps({"type": "input.commit"}))
        events_until(ws, "input_committed")
        ws.send(json.dumps({"type": "response.create"}))
        events, _ = events_until(ws, "response_done")
        levels[kind] = level_heard(events[-1]["text"])
        ws.close()
    assert abs(levels[None] - NOISE_DBFS) <= 1.0 and levels["far_field"] < NOISE_DBFS - 20
    with connect(url, open_timeout=5) as ws:
        ws.send(json.dumps({"type": "session.start", "noise_reduction": "loud"}))
        with pytest.raises(ConnectionClosed) as closed:
            ws.recv(5)
    assert closed.value.rcvd is not None and closed.value.rcvd.code == 1008
    assert closed.value.rcvd.reason.startswith("noise_reduction:")
