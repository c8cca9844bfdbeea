"""Speech-like test signals: a voiced sound webrtcvad calls speech, over a noise floor it calls silence.

For tests, benchmarks and load tests of the session layer, where no recorded speech ships with the
package: a glottal pulse train (~140 Hz) through three formant resonators, with aspiration noise.
"""

from __future__ import annotations

import numpy as np


def voice(rate: int, num_ms: int, seed: int) -> np.ndarray:
    num_samples = rate * num_ms // 1000
    t = np.arange(num_samples) / rate
    phase = np.cumsum(140.0 * (1 + 0.05 * np.sin(2 * np.pi * 3 * t)) / rate)
    source = np.zeros(num_samples)
    source[1:][np.diff(np.floor(phase)) > 0] = 1.0  # one pulse per glottal period
    pulse = np.exp(-np.arange(int(0.003 * rate)) / (0.0008 * rate))  # NOTE: a smooth glottal flow, not a click
    source = np.convolve(source, pulse)[:num_samples]
    source += 0.02 * np.random.default_rng(seed).standard_normal(num_samples)  # aspiration
    response = np.ones(1)
    for formant_hz, bandwidth_hz in ((700, 110), (1220, 120), (2600, 160)):
        radius = np.exp(-np.pi * bandwidth_hz / rate)
        omega = 2 * np.pi * formant_hz / rate
        k = np.arange(int(0.03 * rate))
        response = np.convolve(response, radius**k * np.sin(omega * (k + 1)) / np.sin(omega))
    voiced = np.convolve(source, response)[:num_samples]
    return 0.3 * voiced / np.abs(voiced).max()


def signal_of(rate: int, *segments: tuple[str, int]) -> np.ndarray:
    """float32 audio from ("voice" | "noise", ms) segments, over a -60 dBFS noise floor throughout.

    NOTE: the floor runs under the voice too, as a microphone's does: webrtcvad adapts its noise model
    only on frames it calls non-speech, so noise that first appears after clean speech (a noiseless TTS
    clip, digital silence) can be called speech for seconds. That is not what these tests are about.
    """
    parts = [
        voice(rate, num_ms, seed) if kind == "voice" else np.zeros(rate * num_ms // 1000)
        for seed, (kind, num_ms) in enumerate(segments)
    ]
    signal = np.concatenate(parts)
    return (signal + 0.001 * np.random.default_rng(len(segments)).standard_normal(len(signal))).astype(np.float32)


