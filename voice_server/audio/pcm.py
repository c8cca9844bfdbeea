"""PCM16 byte/array conversions and the base64 framing of Twilio and OpenAI Realtime audio payloads.

Units and dtypes: PCM16 on the wire is 16-bit signed little-endian, mono, no header; in memory it is a
1-D ``np.int16`` array (native byte order). Float audio is ``np.float32`` in [-1, 1): ``x / 32768``,
so every int16 maps exactly to a float32 and back.

Float to int16 rounds half to even (``np.rint``) after scaling by 32768, then clips to -32768..32767.
NaN or +-inf is refused with a ValueError instead of being mapped to a value: a non-finite sample means
the producer (a model, a resampler fed garbage) is broken, and silence or a full-scale click would hide it.
"""

from __future__ import annotations

import base64
import binascii

import numpy as np
import numpy.typing as npt

__all__ = ["NARROWBAND_MAX_RATE", "b64decode", "b64encode", "float32_to_pcm16", "pcm16_from_bytes", "pcm16_to_bytes",
           "pcm16_to_float32"]

PCM16_SCALE = 32768.0
NARROWBAND_MAX_RATE = 8000
"""Audio captured at this rate or lower is narrowband (a phone line's: nothing above 4 kHz). The recogniser
hears such a turn with decoders adapted to it, from its own cepstral mean, and the end-of-turn rules trust its
alternatives less."""
_LE_INT16 = np.dtype("<i2")


def pcm16_from_bytes(data: bytes | bytearray | memoryview) -> npt.NDArray[np.int16]:
    """A writable 1-D int16 array (native order) from little-endian PCM16 bytes (an even byte count)."""
    num_bytes = len(memoryview(data).cast("B"))
    if num_bytes % 2:
        raise ValueError(f"data must hold whole 16-bit samples, got an odd byte count ({num_bytes})")
    return np.frombuffer(data, dtype=_LE_INT16).astype(np.int16)


def pcm16_to_bytes(samples: npt.NDArray[np.int16]) -> bytes:
    """Little-endian PCM16 bytes (2 per sample) of an int16 array of any shape (flattened in C order)."""
    if not isinstance(samples, np.ndarray) or samples.dtype != np.int16:
        got = samples.dtype if isinstance(samples, np.ndarray) else type(samples).__name__
        raise ValueError(f"samples must be a numpy int16 array, got {got}")
    return samples.astype(_LE_INT16, copy=False).tobytes()


def pcm16_to_float32(samples: npt.NDArray[np.int16]) -> npt.NDArray[np.float32]:
    """float32 samples in [-1, 1) (``x / 32768``, exact) from an int16 array of any shape."""
    if not isinstance(samples, np.ndarray) or samples.dtype != np.int16:
        got = samples.dtype if isinstance(samples, np.ndarray) else type(samples).__name__
        raise ValueError(f"samples must be a numpy int16 array, got {got}")
    return samples.astype(np.float32) * np.float32(1.0 / PCM16_SCALE)


def float32_to_pcm16(samples: npt.NDArray[np.floating]) -> npt.NDArray[np.int16]:
    """int16 samples from float audio (nominally [-1, 1)): ``rint(x * 32768)`` clipped to the int16 range.

    Any float dtype is accepted (computed in float32 for float32 input). NaN or +-inf raises ValueError.
    """
    if not isinstance(samples, np.ndarray) or not np.issubdtype(samples.dtype, np.floating):
        got = samples.dtype if isinstance(samples, np.ndarray) else type(samples).__name__
        raise ValueError(f"samples must be a numpy float array, got {got}")
    is_finite = np.isfinite(samples)
    if not is_finite.all():
        num_bad = int(samples.size - np.count_nonzero(is_finite))
        raise ValueError(f"samples holds {num_bad} non-finite value(s) (NaN or inf); refusing to convert to PCM16")
    # NOTE: scaling by a power of two is exact, so int16 -> float32 -> int16 round-trips bit for bit.
    scaled = np.rint(samples * samples.dtype.type(PCM16_SCALE))
    return np.clip(scaled, -32768, 32767).astype(np.int16)


def b64decode(payload: str | bytes) -> bytes:
    """The bytes of a standard-alphabet base64 payload (padding required, no whitespace).

    Raises ValueError naming the problem for anything that is not strict base64, rather than
    silently dropping stray characters as ``base64.b64decode`` does by default.
    """
    if not isinstance(payload, str | bytes):
        raise ValueError(f"payload must be str or bytes, got {type(payload).__name__}")
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise ValueError(f"payload is not valid base64 ({exc}); length {len(payload)}") from exc


def b64encode(data: bytes | bytearray | memoryview) -> str:
    """The standard-alphabet base64 text (with padding) of ``data``, as sent in JSON audio fields."""
    return base64.b64encode(data).decode("ascii")
