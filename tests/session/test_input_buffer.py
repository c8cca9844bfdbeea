"""`InputBuffer`: input at any session rate kept at 16 kHz, resampled once, and cut by input timeline times."""

from __future__ import annotations

import numpy as np
import numpy.typing as npt
import pytest

from voice_server.audio import float32_to_pcm16, resample_signal
from voice_server.session.input_buffer import MAX_BUFFER_S, TRIM_SLACK_S, InputBuffer


def _tones(rate: int, seconds: float) -> npt.NDArray[np.int16]:
    """Two tones under 3.5 kHz (inside every rate's passband), so the 16 kHz copy is the same signal."""
    t = np.arange(int(rate * seconds)) / rate
    return float32_to_pcm16((0.3 * np.sin(2 * np.pi * 440 * t) + 0.2 * np.sin(2 * np.pi * 3100 * t)).astype(np.float32))


def _fed(rate: int, pcm: npt.NDArray[np.int16], chunk: int) -> tuple[InputBuffer, list[npt.NDArray[np.int16]]]:
    buffer = InputBuffer(rate)
    return buffer, [buffer.append(pcm[i:i + chunk]) for i in range(0, pcm.size, chunk)]


@pytest.mark.parametrize("rate", [8000, 24000, 48000])
def test_input_at_another_rate_is_kept_at_16k_equal_to_the_whole_signal_resampled(rate: int) -> None:
    pcm = _tones(rate, 2.0)
    buffer, chunks = _fed(rate, pcm, rate // 50)
    whole = float32_to_pcm16(resample_signal(pcm.astype(np.float32) / 32768, rate, 16000))
    out = np.concatenate(chunks)
    # NOTE: the filter's delay is dropped (sample i is at i / 16 ms); its last few ms come with the next chunk
    assert whole.size - 90 <= out.size < whole.size
    assert np.array_equal(out, whole[:out.size])
    assert np.array_equal(buffer.peek(0), out)
    assert buffer.now_ms == 2000
    assert np.array_equal(buffer.peek(500), out[8000:])


def test_input_at_16k_is_kept_as_it_comes() -> None:
    buffer = InputBuffer(16000)
    chunk = _tones(16000, 0.02)
    assert buffer.append(chunk) is chunk
    assert np.array_equal(buffer.peek(0), chunk)


@pytest.mark.parametrize("rate", [8000, 16000, 24000])
def test_take_cuts_by_timeline_times_and_later_audio_stays_aligned(rate: int) -> None:
    pcm = _tones(rate, 3.0)
    whole = float32_to_pcm16(resample_signal(pcm.astype(np.float32) / 32768, rate, 16000))
    buffer = InputBuffer(rate)
    step = rate // 50
    for i in range(0, rate, step):  # 1 s
        buffer.append(pcm[i:i + step])
    # NOTE: a cut at the timeline's end, past the 16 kHz audio out so far (the resampler's delay)
    taken = buffer.take(200, buffer.now_ms)
    assert np.array_equal(float32_to_pcm16(taken), whole[3200:3200 + taken.size])
    assert 16000 - 3200 - 90 <= taken.size <= 16000 - 3200
    assert buffer.peek(0).size == 0
    for i in range(rate, 2 * rate, step):  # 1 s more
        buffer.append(pcm[i:i + step])
    later = buffer.peek(1000)
    assert later.size > 15900 and np.array_equal(later, whole[16000:16000 + later.size])
    buffer.clear()
    for i in range(2 * rate, 3 * rate, step):
        buffer.append(pcm[i:i + step])
    last = buffer.peek(2500)
    assert buffer.start_ms == 2000 and np.array_equal(last, whole[40000:40000 + last.size])


def test_a_turn_that_never_ends_is_trimmed_to_the_last_max_buffer_s() -> None:
    buffer = InputBuffer(8000)
    second = np.zeros(8000, np.int16)
    for _ in range(MAX_BUFFER_S + TRIM_SLACK_S + 1):
        buffer.append(second)
    assert buffer.peek(0).size == MAX_BUFFER_S * 16000
    assert buffer.start_ms == buffer.now_ms - MAX_BUFFER_S * 1000 - 5  # NOTE: 5 ms: the 8 kHz filter's delay
