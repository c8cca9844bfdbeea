"""End-of-turn models on CPU (onnxruntime), loaded from files inside the installed `pipecat-ai` wheel.

- ``SmartTurnModel``: Smart Turn v3.2 (Daily, BSD-2-Clause), a Whisper-encoder classifier that says
  from the audio alone (prosody, not words) whether a speaker has finished their turn. Input: the last
  8 s of 16 kHz mono, zero-padded at the front, as Whisper log-mel features (80 x 800); output: the
  probability that the turn is complete. File: ``pipecat/audio/turn/smart_turn/data/smart-turn-v3.2-cpu.onnx``
  (8.7 MB, int8). The features are our own numpy code, equal to pipecat's ``_whisper_features.py``
  (itself transformers' ``WhisperFeatureExtractor``) within 1e-4, checked by the tests.
- ``SileroVad``: Silero VAD (snakers4, MIT), a small recurrent model giving the probability of speech in
  each 32 ms window (512 samples at 16 kHz, with the previous window's last 64 samples prepended).
  File: ``pipecat/audio/vad/data/silero_vad.onnx`` (2.3 MB). One ``SileroVad`` per audio stream (it holds
  the recurrent state); many streams share one ``InferenceSession`` (``load_silero_session``).

Both files come from ``pip install --no-deps pipecat-ai==1.14.0``: the package is never imported (its
``__init__`` needs loguru, pydantic, ...), only located with ``importlib.util.find_spec``.

Latency (AMD EPYC, 2 logical cores with another job running, onnxruntime 1.32, one intra-op thread,
median of 50 calls, three runs): ``SmartTurnModel.predict`` on 8 s of audio 48-59 ms (min 48; the features
3-4 ms of it); one Silero window 0.12-0.20 ms through ``feed`` (< 1% of the 32 ms it covers).

NOTE: Smart Turn judges prosody, not syntax: TTS of "I would like to book a table for" (said with a
final, falling contour) scores ~0.99 like a complete question; a text ending in ", and" (continuing
contour) scores ~0.01.

Thread safety: ``InferenceSession.run`` is thread-safe and ``SmartTurnModel.predict`` keeps no state, so
it may run in worker threads (``asyncio.to_thread``) concurrently. A ``SileroVad`` is one stream's state:
feed it from one thread at a time.
"""

from __future__ import annotations

import importlib.util
from collections import deque
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
import onnxruntime as ort
from numpy.lib.stride_tricks import sliding_window_view

from voice_server.audio import frame_levels_db

__all__ = ["SILERO_FILE", "SMART_TURN_FILE", "SileroVad", "SmartTurnModel", "load_silero_session",
           "pipecat_data_file", "whisper_log_mel"]

PIPECAT_HINT = "pip install --no-deps pipecat-ai==1.14.0"
SMART_TURN_FILE = "audio/turn/smart_turn/data/smart-turn-v3.2-cpu.onnx"
SILERO_FILE = "audio/vad/data/silero_vad.onnx"

SAMPLE_RATE = 16000
N_FFT = 400
HOP_LEN = 160
NUM_MELS = 80
MEL_FLOOR = 1e-10
NORM_EPS = 1e-7  # NOTE: transformers' zero-mean unit-variance epsilon (added to the variance)


def pipecat_data_file(relative: str) -> Path:
    """The path of ``relative`` inside the installed pipecat package (which is located, never imported)."""
    spec = importlib.util.find_spec("pipecat")
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    if not locations:
        raise RuntimeError(f"the pipecat package (for {relative}) is not installed: {PIPECAT_HINT}")
    path = Path(locations[0]) / relative
    if not path.is_file():
        raise RuntimeError(f"{path} is missing from the installed pipecat package: {PIPECAT_HINT}")
    return path


def _session(path: Path, num_threads: int) -> ort.InferenceSession:
    options = ort.SessionOptions()
    options.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    options.inter_op_num_threads = 1
    options.intra_op_num_threads = num_threads
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    return ort.InferenceSession(str(path), sess_options=options, providers=["CPUExecutionProvider"])


def _hz_to_mel(hz: npt.NDArray[np.float64]) -> npt.NDArray[np.float64]:
    """Slaney's mel scale: linear (3 mels per 200 Hz) below 1 kHz, logarithmic (27 mels per x6.4) above."""
    log_part = 15.0 + np.log(np.maximum(hz, 1.0) / 1000.0) * (27.0 / np.log(6.4))
    return np.where(hz < 1000.0, 3.0 * hz / 200.0, log_part)


def _mel_to_hz(mel: npt.NDArray[np.float64]) -> npt.NDArray[np.float64]:
    log_part = 1000.0 * np.exp((mel - 15.0) * (np.log(6.4) / 27.0))
    return np.where(mel < 15.0, 200.0 * mel / 3.0, log_part)


def _mel_filters() -> npt.NDArray[np.float64]:
    """Whisper's (NUM_MELS, N_FFT // 2 + 1) filterbank: triangles evenly spaced on the Slaney mel scale over
    0..8 kHz, each scaled by 2 / its width in Hz (Slaney's constant-area norm)."""
    fft_hz = np.linspace(0.0, SAMPLE_RATE / 2, N_FFT // 2 + 1)
    edges_hz = _mel_to_hz(np.linspace(0.0, float(_hz_to_mel(np.array(SAMPLE_RATE / 2))), NUM_MELS + 2))
    left, center, right = edges_hz[:-2, None], edges_hz[1:-1, None], edges_hz[2:, None]
    rising, falling = (fft_hz - left) / (center - left), (right - fft_hz) / (right - center)
    return np.maximum(0.0, np.minimum(rising, falling)) * (2.0 / (right - left))


_MEL_FILTERS = _mel_filters()
# NOTE: periodic Hann (torch.hann_window's default, which Whisper uses), not numpy's symmetric one.
_HANN = 0.5 - 0.5 * np.cos(2.0 * np.pi * np.arange(N_FFT) / N_FFT)


def whisper_log_mel(audio: npt.NDArray[np.floating]) -> npt.NDArray[np.float32]:
    """Whisper log-mel features of 1-D 16 kHz audio (do_normalize=True), shape (80, len(audio) // 160)."""
    x = np.asarray(audio, dtype=np.float32)
    # NOTE: the waveform's zero-mean unit-variance in float32 (as transformers does it) before the STFT.
    x = (x - x.mean()) / np.sqrt(x.var() + NORM_EPS)
    padded = np.pad(x.astype(np.float64), N_FFT // 2, mode="reflect")  # centered frames
    frames = sliding_window_view(padded, N_FFT)[::HOP_LEN]
    power = np.abs(np.fft.rfft(frames * _HANN, axis=-1)) ** 2
    log_mel = np.log10(np.maximum(_MEL_FILTERS @ power.T, MEL_FLOOR))[:, :-1]  # NOTE: Whisper drops the last frame
    log_mel = np.maximum(log_mel, log_mel.max() - 8.0)  # 80 dB of dynamic range
    return ((log_mel + 4.0) / 4.0).astype(np.float32)


class SmartTurnModel:
    """Smart Turn v3.2: the probability that the speaker has finished, from the last 8 s of their audio."""

    SAMPLE_RATE = SAMPLE_RATE
    MAX_AUDIO_S = 8

    def __init__(self, path: Path | None = None, num_threads: int = 1) -> None:
        self.session = _session(path or pipecat_data_file(SMART_TURN_FILE), num_threads)
        self.input_name = self.session.get_inputs()[0].name  # "input_features", (batch, 80, 800)

    def features(self, audio: npt.NDArray[np.float32]) -> npt.NDArray[np.float32]:
        """The model's input (1, 80, 800): the last 8 s of ``audio``, zero-padded at the front."""
        if audio.ndim != 1 or len(audio) == 0:
            raise ValueError(f"expected non-empty 1-D audio, got shape {audio.shape}")
        audio_len = self.SAMPLE_RATE * self.MAX_AUDIO_S
        window = np.zeros(audio_len, np.float32)
        tail = audio[-audio_len:]
        window[audio_len - len(tail):] = tail
        return whisper_log_mel(window)[None]

    def predict(self, audio: npt.NDArray[np.float32]) -> float:
        """The probability in [0, 1] that the turn is complete (16 kHz float32 mono, any length > 0)."""
        outputs: list[Any] = self.session.run(None, {self.input_name: self.features(audio)})
        # NOTE: the output is named "logits" but holds probabilities (pipecat reads it so; seen 0.006-0.99).
        return float(np.clip(outputs[0][0, 0], 0.0, 1.0))


def load_silero_session(path: Path | None = None, num_threads: int = 1) -> ort.InferenceSession:
    """One Silero VAD session, to share among the ``SileroVad`` streams of a process."""
    return _session(path or pipecat_data_file(SILERO_FILE), num_threads)


class SileroVad:
    """Streaming speech probability of one 16 kHz stream: one value per 512-sample (32 ms) window.

    Calling convention of pipecat's ``SileroOnnxModel``: input (1, 64 + 512), the window after the
    previous window's last 64 samples (zeros after a reset); state (2, 1, 128) float32; sr int64 scalar.

    Periodic reset (``is_periodic_reset``, as pipecat's ``SileroVADAnalyzer``): non-speech (noise, music,
    long silence) drifts the recurrent state so that later speech is under-reported; so once >= 2 s of
    windows have passed since the last reset, the state is reset after 5 windows in a row score < 0.1
    (clear non-speech, never a dip inside a word). NOTE: pipecat also requires its analyzer to be QUIET
    (200 ms below its 0.7 threshold), which those 160 ms below 0.1 nearly imply.

    ``skip`` stands for ``score`` where the caller knows a window holds no speech (digital silence, a quiet
    room's open microphone): it scores 0 without running the model and counts as a clear non-speech window
    for the periodic reset. The next ``score`` first runs the last ``NUM_REPLAYED_WINDOWS`` skipped windows
    through the model: after a short skip the stream scores exactly as if it had scored every window, after a
    long one from a state that has heard the last ~128 ms (over the turn-taking set's items, 3 seeds, 28 of 219
    turns opened a window or two off, most sooner; with no replay 46). ``windows`` then
    ``score`` or ``skip`` let a caller choose per window.
    """

    WINDOW = 512
    CONTEXT_LEN = 64
    RESET_INTERVAL_WINDOWS = -(-2 * SAMPLE_RATE // WINDOW)  # 63: the first window count covering 2 s
    RESET_MAX_PROB = 0.1
    RESET_NUM_LOW_WINDOWS = 5
    NUM_REPLAYED_WINDOWS = 4

    def __init__(self, session_or_path: ort.InferenceSession | Path | None = None, num_threads: int = 1,
                 is_periodic_reset: bool = True) -> None:
        if isinstance(session_or_path, ort.InferenceSession):
            self.session = session_or_path
        else:
            self.session = load_silero_session(session_or_path, num_threads)
        self.is_periodic_reset = is_periodic_reset
        self._sr = np.array(SAMPLE_RATE, dtype=np.int64)
        self._pending = np.zeros(0, np.float32)
        self.reset()

    def reset(self) -> None:
        """A fresh stream: zero state and context, no buffered input."""
        self._reset_model()
        self._pending = np.zeros(0, np.float32)
        self._num_low_windows = 0

    def _reset_model(self) -> None:
        # NOTE: the run of low windows is kept (as pipecat does): it describes the audio, not the model.
        self._state = np.zeros((2, 1, 128), np.float32)
        self._context = np.zeros((1, self.CONTEXT_LEN), np.float32)
        self._skipped: deque[npt.NDArray[np.float32]] = deque(maxlen=self.NUM_REPLAYED_WINDOWS)
        self._num_windows_since_reset = 0

    def feed(self, audio16k: npt.NDArray[np.float32]) -> list[float]:
        """Buffers ``audio16k`` and returns the speech probability of each window it completes, in order."""
        return [probability for probability, _ in self.feed_windows(audio16k)]

    def feed_windows(self, audio16k: npt.NDArray[np.float32]) -> list[tuple[float, float]]:
        """As ``feed``, each window's probability with its RMS level (dBFS)."""
        return [(self.score(window), level) for window, level in self.windows(audio16k)]

    def windows(self, audio16k: npt.NDArray[np.float32]) -> list[tuple[npt.NDArray[np.float32], float]]:
        """Buffers ``audio16k`` and returns the windows it completes with their RMS levels (dBFS), in order:
        each must then be given to ``score`` or ``skip``, in that order."""
        pending = np.concatenate([self._pending, np.asarray(audio16k, dtype=np.float32).reshape(-1)])
        num_windows = len(pending) // self.WINDOW
        windows = pending[: num_windows * self.WINDOW].reshape(num_windows, self.WINDOW)
        levels = frame_levels_db(windows.reshape(-1), SAMPLE_RATE, self.WINDOW * 1000 // SAMPLE_RATE)
        self._pending = pending[num_windows * self.WINDOW:].copy()
        return [(window, float(level)) for window, level in zip(windows, levels, strict=True)]

    def score(self, window: npt.NDArray[np.float32]) -> float:
        """The speech probability of the stream's next window (of ``windows``)."""
        for x in self._skipped:
            self._run(x)
        self._skipped.clear()
        x = np.concatenate([self._context, window[None]], axis=1)
        prob = self._run(x)
        self._context = x[:, -self.CONTEXT_LEN:]
        self._count(prob)
        return prob

    def skip(self, window: npt.NDArray[np.float32]) -> float:
        """0, for the stream's next window, without the model (see the class docstring)."""
        x = np.concatenate([self._context, window[None]], axis=1)
        self._skipped.append(x)
        self._context = x[:, -self.CONTEXT_LEN:]
        self._count(0.0)
        return 0.0

    def _run(self, x: npt.NDArray[np.float32]) -> float:
        outputs: list[Any] = self.session.run(None, {"input": x, "state": self._state, "sr": self._sr})
        self._state = outputs[1]
        return float(outputs[0][0, 0])

    def _count(self, prob: float) -> None:
        if self.is_periodic_reset:
            self._num_windows_since_reset += 1
            self._num_low_windows = self._num_low_windows + 1 if prob < self.RESET_MAX_PROB else 0
            if (self._num_windows_since_reset >= self.RESET_INTERVAL_WINDOWS
                    and self._num_low_windows >= self.RESET_NUM_LOW_WINDOWS):
                self._reset_model()
