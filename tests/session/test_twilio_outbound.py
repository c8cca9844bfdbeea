"""Twilio outbound frames, the PCM -> 20 ms mu-law encoder (round trip through G.711) and the start token."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from voice_server.audio import StreamResampler, b64decode, ulaw_decode, ulaw_encode
from voice_server.session.twilio import (
    NUM_FRAME_SAMPLES,
    TwilioAudioEncoder,
    TwilioMediaFormat,
    TwilioStart,
    build_clear_message,
    build_mark_message,
    build_media_message,
    is_authorized,
    start_token,
)

STREAM = "MZ18ad3ab5a668481ce02b83e7395059f0"


def _tone(rate: int, duration_ms: int, frequency_hz: float = 440.0) -> np.ndarray:
    t = np.arange(rate * duration_ms // 1000) / rate
    return (0.4 * 32767 * np.sin(2 * np.pi * frequency_hz * t)).astype(np.int16)


def test_builders_match_twilio_shapes() -> None:
    media = json.loads(build_media_message(STREAM, b"\xff\x7f\x00"))
    assert media == {"event": "media", "streamSid": STREAM, "media": {"payload": "/38A"}}
    assert json.loads(build_mark_message(STREAM, "vs1")) == {"event": "mark", "streamSid": STREAM,
                                                             "mark": {"name": "vs1"}}
    assert json.loads(build_clear_message(STREAM)) == {"event": "clear", "streamSid": STREAM}


@pytest.mark.parametrize(
    "call",
    [
        lambda: build_media_message("", b"\x00"),
        lambda: build_media_message(STREAM, b""),
        lambda: build_media_message(STREAM, "abc"),
        lambda: build_mark_message(STREAM, ""),
        lambda: build_mark_message(STREAM, "x" * 257),
        lambda: build_clear_message(None),
    ],
)
def test_builders_refuse_bad_arguments(call: object) -> None:
    with pytest.raises(ValueError):
        call()  # type: ignore[operator]


@pytest.mark.parametrize("rate", [8000, 16000, 24000, 48000])
def test_encoded_media_round_trips_to_the_resampled_input(rate: int) -> None:
    pcm = _tone(rate, 500)
    encoder = TwilioAudioEncoder(rate)
    frames: list[bytes] = []
    for start in range(0, len(pcm), 137 * rate // 8000):  # NOTE: chunks unrelated to 20 ms
        frames += encoder.encode(pcm[start : start + 137 * rate // 8000])
    frames += encoder.flush()
    payloads = [b64decode(json.loads(build_media_message(STREAM, f))["media"]["payload"]) for f in frames]
    assert payloads == frames
    decoded = ulaw_decode(np.frombuffer(b"".join(payloads), dtype=np.uint8)).astype(np.int32)
    resampler = StreamResampler(rate, 8000)
    expected = np.concatenate((resampler.process_int16(pcm), resampler.flush_int16())).astype(np.int32)
    assert len(decoded) == len(expected) == 4000 + resampler.spec.delay_out
    # NOTE: mu-law's step is 2**(segment+3) in 16-bit units; half of it bounds the quantisation error.
    step = np.abs(ulaw_decode(ulaw_encode(expected.astype(np.int16))).astype(np.int32) - expected)
    assert np.all(np.abs(decoded - expected) == step)
    assert np.max(step) <= 512
    snr_db = 10 * np.log10(np.sum(expected.astype(float) ** 2) / np.sum((decoded - expected).astype(float) ** 2))
    assert snr_db > 30


def test_frames_are_20_ms_and_only_the_last_is_short() -> None:
    encoder = TwilioAudioEncoder(24000)
    first = encoder.encode(_tone(24000, 50))  # 400 samples at 8 kHz: 2 frames, 80 kept
    assert [len(f) for f in first] == [NUM_FRAME_SAMPLES] * 2 and encoder.num_buffered_samples == 80
    assert encoder.encode(np.zeros(0, dtype=np.int16)) == []
    rest = encoder.flush()
    tail = 80 + StreamResampler(24000, 8000).spec.delay_out
    assert [len(f) for f in rest] == [tail] and encoder.num_buffered_samples == 0
    assert encoder.flush() == []


def test_reset_drops_buffered_audio() -> None:
    encoder = TwilioAudioEncoder(16000)
    encoder.encode(_tone(16000, 15))
    assert encoder.num_buffered_samples == 120  # NOTE: the resampler returns ceil(N / 2) at once
    encoder.reset()
    assert encoder.num_buffered_samples == 0 and encoder.flush() == []
    assert encoder.rate_in == 16000
    # NOTE: after a reset the next utterance starts clean: the same frames as a fresh encoder's.
    assert encoder.encode(_tone(16000, 60)) == TwilioAudioEncoder(16000).encode(_tone(16000, 60))


def test_encoder_refuses_bad_input() -> None:
    encoder = TwilioAudioEncoder(16000)
    with pytest.raises(ValueError, match="1-D numpy int16"):
        encoder.encode(np.zeros(10, dtype=np.float32))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="rate_in"):
        TwilioAudioEncoder(11025)


def _start(params: dict[str, str]) -> TwilioStart:
    fmt = TwilioMediaFormat("audio/x-mulaw", 8000, 1)
    return TwilioStart(1, STREAM, "AC1", "CA1", ("inbound",), params, fmt)


@pytest.mark.parametrize(
    ("params", "token"),
    [
        ({"token": "s3cret"}, "s3cret"),
        ({"Authorization": "Bearer s3cret"}, "s3cret"),
        ({"authorization": "bearer  s3cret "}, "s3cret"),
        ({"authorization": "s3cret"}, "s3cret"),
        ({"TOKEN": "s3cret", "other": "x"}, "s3cret"),
        ({}, None),
        ({"token": ""}, None),
        ({"token": "Bearer "}, None),
        ({"token": "s3cret", "authorization": "Bearer s3cret"}, None),  # ambiguous: refused
    ],
)
def test_start_token(params: dict[str, str], token: str | None) -> None:
    assert start_token(_start(params)) == token
    assert is_authorized(_start(params), "s3cret") is (token == "s3cret")


def test_is_authorized_refuses_wrong_tokens_and_survives_odd_text() -> None:
    assert not is_authorized(_start({"token": "s3cre"}), "s3cret")
    assert not is_authorized(_start({"token": "s3cret\ud800"}), "s3cret")  # a lone surrogate from JSON
    assert is_authorized(_start({"token": "h\u00e9"}), "h\u00e9")
    with pytest.raises(ValueError, match="expected_token"):
        is_authorized(_start({"token": "x"}), "")


def test_the_package_does_not_import_torch() -> None:
    """The process serving sessions must stay free of torch (start-up time and memory per worker)."""
    code = "import sys, voice_server.session.twilio; assert 'torch' not in sys.modules, 'torch imported'"
    subprocess.run([sys.executable, "-c", code], check=True, cwd=Path(__file__).resolve().parents[2])
