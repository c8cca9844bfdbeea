"""StreamResampler: chunking invariance, lengths, the filter's documented quality, round trips."""

from __future__ import annotations

import itertools
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from voice_server.audio import (
    SUPPORTED_RATES,
    ResamplerSpec,
    StreamResampler,
    float32_to_pcm16,
    pcm16_to_float32,
    resample_signal,
)
from voice_server.audio import resample as resample_module
from voice_server.audio.resample import _phase_filters

STANDARD_RATES = (8000, 16000, 24000, 48000)
STANDARD_PAIRS = [(a, b) for a, b in itertools.permutations(STANDARD_RATES, 2)]
ALL_PAIRS = list(itertools.permutations(SUPPORTED_RATES, 2))


def _noise(num_samples: int, seed: int = 0) -> np.ndarray:
    return (np.random.default_rng(seed).standard_normal(num_samples) * 0.2).astype(np.float32)


def _random_chunks(signal: np.ndarray, rng: np.random.Generator) -> list[np.ndarray]:
    """Chunks of 0, 1, a few and many samples in random order."""
    chunks, start = [], 0
    while start < len(signal):
        size = int(rng.choice([0, 1, 1, 2, 3, 7, 160, 480, 961]))
        chunks.append(signal[start : start + size])
        start += size
    return chunks


def _stream(resampler: StreamResampler, chunks: list[np.ndarray]) -> np.ndarray:
    outputs = [resampler.process(chunk) for chunk in chunks]
    assert all(out.dtype == np.float32 for out in outputs)
    return np.concatenate([*outputs, resampler.flush()])


@pytest.mark.parametrize(("rate_in", "rate_out"), ALL_PAIRS)
def test_any_chunking_is_bit_exact(rate_in: int, rate_out: int) -> None:
    signal = _noise(rate_in // 5, seed=rate_in + rate_out)
    whole = _stream(StreamResampler(rate_in, rate_out), [signal])
    rng = np.random.default_rng(rate_in * 7 + rate_out)
    resampler = StreamResampler(rate_in, rate_out)
    for _ in range(3):  # NOTE: flush resets, so one resampler serves three streams
        chunked = _stream(resampler, _random_chunks(signal, rng))
        assert chunked.tobytes() == whole.tobytes()


@settings(max_examples=40, deadline=None)
@given(
    sizes=st.lists(st.integers(min_value=0, max_value=40), min_size=1, max_size=30),
    pair=st.sampled_from([(24000, 16000), (16000, 24000), (8000, 48000), (44100, 16000)]),
)
def test_chunk_boundaries_property(sizes: list[int], pair: tuple[int, int]) -> None:
    signal = _noise(sum(sizes), seed=len(sizes))
    bounds = np.cumsum([0, *sizes])
    chunks = [signal[a:b] for a, b in itertools.pairwise(bounds)]
    chunked = _stream(StreamResampler(*pair), chunks)
    assert chunked.tobytes() == _stream(StreamResampler(*pair), [signal]).tobytes()


@pytest.mark.parametrize(("rate_in", "rate_out"), ALL_PAIRS)
@pytest.mark.parametrize("num_input", [0, 1, 2, 5, 479, 1000])
def test_output_lengths_follow_the_formula(rate_in: int, rate_out: int, num_input: int) -> None:
    spec = ResamplerSpec.for_rates(rate_in, rate_out)
    resampler = StreamResampler(rate_in, rate_out)
    streamed = resampler.process(_noise(num_input))
    expected = -(-num_input * rate_out // rate_in)  # ceil(N * rate_out / rate_in) == ceil(N * L / M)
    assert len(streamed) == spec.num_output(num_input) == expected == resampler.num_output
    assert len(resampler.flush()) == spec.delay_out
    assert len(resample_signal(_noise(num_input), rate_in, rate_out)) == expected


def test_documented_delays() -> None:
    delays = {pair: ResamplerSpec.for_rates(*pair).delay_out for pair in STANDARD_PAIRS}
    assert delays[(48000, 16000)] == 40 and delays[(24000, 8000)] == 40
    assert delays[(8000, 24000)] == 120 and delays[(16000, 24000)] == 60
    for rate_in, rate_out in STANDARD_PAIRS:
        spec = ResamplerSpec.for_rates(rate_in, rate_out)
        assert spec.delay_in == int(spec.delay_in)  # whole in input samples too
        assert spec.delay_out / rate_out == pytest.approx(40 / min(rate_in, rate_out))  # 40 low-rate samples
    same = ResamplerSpec.for_rates(16000, 16000)
    assert (same.delay_out, same.taps_per_phase) == (0, 1)


@pytest.mark.parametrize(("rate_in", "rate_out"), ALL_PAIRS)
def test_prototype_meets_the_documented_quality(rate_in: int, rate_out: int) -> None:
    spec = ResamplerSpec.for_rates(rate_in, rate_out)
    prototype = _phase_filters(spec)[:, ::-1].T.reshape(-1).astype(np.float64)  # back to tap order
    num_fft = 1 << int(np.ceil(np.log2(len(prototype) * 16)))
    gain_db = 20 * np.log10(np.abs(np.fft.rfft(prototype, num_fft)) / spec.up + 1e-300)
    freqs = np.fft.rfftfreq(num_fft, 1 / (spec.up * rate_in))
    low = min(rate_in, rate_out)
    passband = gain_db[freqs <= 0.45 * low]
    assert passband.min() > -0.01 and passband.max() < 0.01
    assert gain_db[freqs >= 0.5 * low].max() < -60.0


def _tone(freq: float, rate: int, num_samples: int, amplitude: float = 0.5, delay: float = 0.0) -> np.ndarray:
    t = (np.arange(num_samples) - delay) / rate
    return amplitude * np.sin(2 * np.pi * freq * t)


def test_1khz_sine_48k_16k_48k_keeps_amplitude_and_snr() -> None:
    signal = _tone(1000.0, 48000, 48000).astype(np.float32)
    down, up = StreamResampler(48000, 16000), StreamResampler(16000, 48000)
    mid = np.concatenate([down.process(signal), down.flush()])
    out = np.concatenate([up.process(mid), up.flush()]).astype(np.float64)
    delay = down.spec.delay_out * 3 + up.spec.delay_out  # in 48 kHz samples
    assert delay == 240
    aligned = out[delay : delay + len(signal)]
    steady = slice(2000, len(signal) - 2000)  # NOTE: away from the start-up and tail transients
    reference = signal[steady].astype(np.float64)
    residual = aligned[steady] - reference
    snr_db = 10 * np.log10(np.sum(reference**2) / np.sum(residual**2))
    amplitude_db = 20 * np.log10(np.sqrt(np.mean(aligned[steady] ** 2)) / np.sqrt(np.mean(reference**2)))
    assert snr_db > 50.0 and abs(amplitude_db) < 0.1, (snr_db, amplitude_db)


@pytest.mark.parametrize(
    ("rate_in", "rate_out", "freq"),
    [
        (48000, 16000, 8200.0),
        (48000, 16000, 9000.0),
        (48000, 16000, 15000.0),
        (48000, 16000, 23000.0),
        (24000, 8000, 4150.0),
        (24000, 8000, 7000.0),
        (24000, 16000, 8300.0),
        (16000, 8000, 4100.0),
        (44100, 16000, 12000.0),
        (22050, 16000, 10000.0),
        (22050, 8000, 4500.0),
    ],
)
def test_tone_above_target_nyquist_is_attenuated_60db(rate_in: int, rate_out: int, freq: float) -> None:
    signal = _tone(freq, rate_in, rate_in // 2).astype(np.float32)
    out = resample_signal(signal, rate_in, rate_out).astype(np.float64)
    steady = out[len(out) // 4 : -len(out) // 4]
    level_db = 20 * np.log10(np.sqrt(np.mean(steady**2)) / np.sqrt(np.mean(signal.astype(np.float64) ** 2)))
    assert level_db < -60.0, level_db


def test_upsampling_leaves_no_images() -> None:
    signal = _tone(1000.0, 8000, 8000).astype(np.float32)
    out = resample_signal(signal, 8000, 24000).astype(np.float64)[2000:-2000]
    spectrum = np.abs(np.fft.rfft(out * np.kaiser(len(out), 20.0)))
    freqs = np.fft.rfftfreq(len(out), 1 / 24000)
    image_db = 20 * np.log10(spectrum[freqs >= 4000].max() / spectrum.max())
    assert image_db < -60.0, image_db  # images at 7, 9, 15, 17 kHz are gone


def test_8k_24k_8k_round_trip() -> None:
    num_samples = 8000
    signal = sum(_tone(f, 8000, num_samples, 0.2) for f in (300.0, 1000.0, 2900.0, 3500.0)).astype(np.float32)
    up = resample_signal(signal, 8000, 24000)
    back = resample_signal(up, 24000, 8000)
    assert len(up) == 3 * num_samples and len(back) == num_samples
    steady = slice(200, num_samples - 200)
    residual = back[steady].astype(np.float64) - signal[steady]
    snr_db = 10 * np.log10(np.sum(signal[steady].astype(np.float64) ** 2) / np.sum(residual**2))
    assert snr_db > 50.0, snr_db
    # the 24 kHz signal is the same tones, delay removed: sample 3n sits on input sample n
    reference = sum(_tone(f, 24000, 3 * num_samples, 0.2) for f in (300.0, 1000.0, 2900.0, 3500.0))
    mid = slice(600, 3 * num_samples - 600)
    up_residual = up[mid] - reference[mid]
    assert 10 * np.log10(np.sum(reference[mid] ** 2) / np.sum(up_residual**2)) > 50.0


def test_equal_rates_copy_the_input() -> None:
    signal = _noise(1000)
    resampler = StreamResampler(24000, 24000)
    assert resampler.process(signal).tobytes() == signal.tobytes()
    assert len(resampler.flush()) == 0


def test_int16_convenience_matches_the_float_path() -> None:
    pcm = float32_to_pcm16(_noise(4800, seed=3) * 3)  # NOTE: clipped peaks exercise the rounding/clipping
    a, b = StreamResampler(48000, 16000), StreamResampler(48000, 16000)
    got = np.concatenate([a.process_int16(pcm[:1000]), a.process_int16(pcm[1000:]), a.flush_int16()])
    want = float32_to_pcm16(np.concatenate([b.process(pcm16_to_float32(pcm)), b.flush()]))
    assert got.dtype == np.int16
    np.testing.assert_array_equal(got, want)


def test_float64_input_gives_float32_output() -> None:
    out = StreamResampler(16000, 8000).process(_noise(100).astype(np.float64))
    assert out.dtype == np.float32 and len(out) == 50


@pytest.mark.parametrize(("rate_in", "rate_out", "name"), [(32000, 16000, "rate_in"), (16000, 11025, "rate_out")])
def test_unsupported_rates_name_the_argument(rate_in: int, rate_out: int, name: str) -> None:
    with pytest.raises(ValueError, match=f"{name} must be one of"):
        StreamResampler(rate_in, rate_out)
    with pytest.raises(ValueError, match="rate_in must be one of .* got 16000.0"):
        StreamResampler(16000.0, 8000)  # type: ignore[arg-type]


def test_bad_samples_name_the_argument() -> None:
    resampler = StreamResampler(16000, 8000)
    with pytest.raises(ValueError, match="samples must be a 1-D float numpy array .* got int16"):
        resampler.process(np.zeros(4, dtype=np.int16))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"samples must be .* shape \(2, 2\)"):
        resampler.process(np.zeros((2, 2), dtype=np.float32))
    with pytest.raises(ValueError, match="samples must be .* got list"):
        resampler.process([0.0, 1.0])  # type: ignore[arg-type]


def test_audio_package_does_not_import_torch() -> None:
    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")])}
    code = "import sys, voice_server.audio; assert 'torch' not in sys.modules, 'torch imported'"
    subprocess.run([sys.executable, "-c", code], check=True, cwd=root, env=env)


def test_long_inputs_run_in_blocks_with_the_same_result(monkeypatch: pytest.MonkeyPatch) -> None:
    signal = _noise(24000, seed=5)
    whole = _stream(StreamResampler(24000, 16000), [signal])
    monkeypatch.setattr(resample_module, "_MAX_BLOCK_PRODUCTS", 1000)  # ~8 outputs per block
    assert _stream(StreamResampler(24000, 16000), [signal]).tobytes() == whole.tobytes()


@pytest.mark.parametrize(("rate_in", "rate_out"), STANDARD_PAIRS)
def test_strided_phases_match_gathered_windows(rate_in: int, rate_out: int, monkeypatch: pytest.MonkeyPatch) -> None:
    signal = _noise(rate_in // 4, seed=rate_out)
    chunks = _random_chunks(signal, np.random.default_rng(rate_in + 3 * rate_out))
    assert ResamplerSpec.for_rates(rate_in, rate_out).up <= resample_module.MAX_STRIDED_UP
    strided = _stream(StreamResampler(rate_in, rate_out), chunks)
    monkeypatch.setattr(resample_module, "MAX_STRIDED_UP", 0)
    assert _stream(StreamResampler(rate_in, rate_out), chunks).tobytes() == strided.tobytes()
