"""Audibility: frame levels, and `PlayoutClock`'s model of when a client hears what was sent (played
on arrival, or after what it queued before, whichever is later)."""

from __future__ import annotations

import numpy as np
import pytest

from voice_server.audio import AUDIBLE_DB, PlayoutClock, float32_to_pcm16, frame_levels_db

RATE = 24000


def tone(ms: int, db: float) -> np.ndarray:
    t = np.arange(RATE * ms // 1000) / RATE
    return (10 ** (db / 20) * np.sqrt(2) * np.sin(2 * np.pi * 300 * t)).astype(np.float32)


def quiet(ms: int) -> np.ndarray:
    return (1e-4 * np.random.default_rng(0).standard_normal(RATE * ms // 1000)).astype(np.float32)


def test_frame_levels_are_rms_dbfs_per_10_ms_for_floats_and_int16() -> None:
    pcm = np.concatenate([tone(100, -20), quiet(50), tone(5, -6)])
    levels = frame_levels_db(pcm, RATE)
    assert levels.size == 16  # NOTE: 15.5 frames: the partial last one is a frame of its own
    assert np.allclose(levels[:10], -20, atol=0.2) and (levels[10:15] < -70).all()
    assert levels[15] == pytest.approx(-6, abs=0.5)  # NOTE: a partial frame is not diluted by padding
    from_int16 = frame_levels_db(float32_to_pcm16(pcm), RATE)
    loud = np.r_[0:10, 15]  # NOTE: -80 dBFS frames are a few int16 steps: rounding moves them by tenths of a dB
    assert np.allclose(from_int16[loud], levels[loud], atol=0.05) and np.allclose(from_int16, levels, atol=2)
    assert frame_levels_db(np.zeros(0, np.float32), RATE).size == 0


def test_silence_before_speech_delays_the_first_audible_frame_not_the_first_byte() -> None:
    clock = PlayoutClock(RATE)
    clock.sent(quiet(300), now=10.0)
    assert clock.first_byte_at == 10.0 and clock.first_audible_at is None
    clock.sent(np.concatenate([quiet(20), tone(200, -20)]), now=10.05)  # NOTE: queued behind 300 ms
    assert clock.first_audible_at == pytest.approx(10.0 + 0.3 + 0.02)
    assert clock.play_end_at == pytest.approx(10.52)


def test_an_underrun_plays_the_next_chunk_on_arrival() -> None:
    clock = PlayoutClock(RATE)
    clock.sent(quiet(100), now=1.0)
    clock.sent(tone(100, -30), now=2.0)  # NOTE: the queue ran dry at 1.1 s
    assert clock.first_audible_at == pytest.approx(2.0)


def test_a_frame_split_across_chunks_is_judged_whole() -> None:
    # NOTE: a loud 10 ms frame whose halves arrive in two chunks: neither half alone holds a whole frame.
    signal = np.concatenate([quiet(10), tone(10, -20), quiet(30)])
    cut = RATE * 15 // 1000
    clock = PlayoutClock(RATE)
    clock.sent(signal[:cut], now=0.0)
    assert clock.first_audible_at is None
    clock.sent(signal[cut:], now=0.001)
    assert clock.first_audible_at == pytest.approx(0.01)


def test_a_reply_below_the_level_is_never_audible() -> None:
    clock = PlayoutClock(RATE)
    for i in range(5):
        clock.sent(tone(100, AUDIBLE_DB - 6), now=0.1 * i)
    assert clock.first_byte_at == 0.0 and clock.first_audible_at is None
    clock.sent(float32_to_pcm16(tone(40, AUDIBLE_DB + 6)), now=0.2)
    assert clock.first_audible_at == pytest.approx(0.5)
