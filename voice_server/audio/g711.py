"""G.711 mu-law and A-law codecs (ITU-T G.711), bit-exact with the ITU-T G.191 reference ``g711.c``.

Units and dtypes: linear samples are 16-bit signed PCM (``np.int16``, full scale -32768..32767);
companded samples are one byte each (``np.uint8``, the octet as sent on the wire, with the standard's
bit inversions already applied: mu-law inverts all bits, A-law toggles the even bits with 0x55).

Encoding rule (the G.191 reference, not Sun's ``linear2ulaw``):

- mu-law takes the 14 most significant bits. A negative sample is first replaced by its one's complement
  (``~x``, i.e. ``-x - 1``) so that quantisation is symmetric about -0.5 (G.711 is a mid-riser code).
  The magnitude is biased by 33 (0x84 in 16-bit units) and clipped to 8191 (a 16-bit magnitude of
  32635 plus the bias), then split into segment and mantissa.
- A-law takes the 12 most significant bits, one's complement for negatives too, and toggles the even bits.

NOTE: Sun's and CPython ``audioop``'s mu-law encoders negate negative samples instead of complementing
them, so for some negative inputs (those whose 14-bit magnitude lands on a decision value) their code is
one step away from this one; decoding is the same in all of them, and so is A-law.

Both directions are a single lookup into tables built once at import (a 65536-entry encode table
indexed by the sample's bit pattern, a 256-entry decode table), so any array shape costs one gather.
"""

from __future__ import annotations

from typing import TypeVar

import numpy as np
import numpy.typing as npt

__all__ = ["alaw_decode", "alaw_encode", "ulaw_decode", "ulaw_encode"]

# NOTE: every int16 value, in the order of its uint16 bit pattern, so `table[x.view(np.uint16)]` works.
_ALL_PCM16 = np.arange(65536, dtype=np.uint32).astype(np.uint16).view(np.int16).astype(np.int32)
_ALL_CODES = np.arange(256, dtype=np.int32)


def _bit_length(values: npt.NDArray[np.int32], num_bits: int) -> npt.NDArray[np.int32]:
    """`int.bit_length` for non-negative values below 2**num_bits, vectorised."""
    length = np.zeros_like(values)
    for bit in range(num_bits):
        length += (values >= (1 << bit)).astype(np.int32)
    return length


def _build_ulaw_encode() -> npt.NDArray[np.uint8]:
    x = _ALL_PCM16
    # NOTE: one's complement for negatives, as the reference: keeps the code symmetric (mid-riser).
    absno = np.minimum((np.where(x < 0, ~x, x) >> 2) + 33, 0x1FFF)
    segno = 1 + _bit_length(absno >> 6, 7)  # 1..8
    high_nibble = 8 - segno
    low_nibble = 15 - ((absno >> segno) & 0xF)
    codes = (high_nibble << 4) | low_nibble
    codes = np.where(x >= 0, codes | 0x80, codes)
    return codes.astype(np.uint8)


def _build_alaw_encode() -> npt.NDArray[np.uint8]:
    x = _ALL_PCM16
    ix = np.where(x < 0, ~x, x) >> 4  # 0..2047
    exponent = np.maximum(_bit_length(ix, 11) - 4, 1)  # 1..7 where ix > 15
    mantissa = (ix >> (exponent - 1)) - 16
    codes = np.where(ix > 15, mantissa + (exponent << 4), ix)
    codes = np.where(x >= 0, codes | 0x80, codes)
    return (codes ^ 0x55).astype(np.uint8)


def _build_ulaw_decode() -> npt.NDArray[np.int16]:
    inverted = ~_ALL_CODES & 0xFF
    exponent = (inverted >> 4) & 0x7
    mantissa = inverted & 0xF
    step = 4 << (exponent + 1)
    magnitude = (0x80 << exponent) + step * mantissa + step // 2 - 4 * 33
    return np.where(_ALL_CODES < 0x80, -magnitude, magnitude).astype(np.int16)


def _build_alaw_decode() -> npt.NDArray[np.int16]:
    ix = (_ALL_CODES ^ 0x55) & 0x7F
    exponent = ix >> 4
    mantissa = np.where(exponent > 0, (ix & 0xF) + 16, ix & 0xF)
    magnitude = (mantissa << 4) + 8  # NOTE: + half a quantisation step
    magnitude = np.where(exponent > 1, magnitude << np.maximum(exponent - 1, 0), magnitude)
    return np.where(_ALL_CODES > 127, magnitude, -magnitude).astype(np.int16)


_Table = TypeVar("_Table", bound=np.ndarray)


def _frozen(table: _Table) -> _Table:
    table.setflags(write=False)
    return table


_ULAW_ENCODE = _frozen(_build_ulaw_encode())
_ALAW_ENCODE = _frozen(_build_alaw_encode())
_ULAW_DECODE = _frozen(_build_ulaw_decode())
_ALAW_DECODE = _frozen(_build_alaw_decode())


def _check_dtype(array: np.ndarray, name: str, dtype: type[np.generic]) -> None:
    if not isinstance(array, np.ndarray) or array.dtype != dtype:
        got = array.dtype if isinstance(array, np.ndarray) else type(array).__name__
        raise ValueError(f"{name} must be a numpy array of {np.dtype(dtype).name}, got {got}")


def ulaw_encode(pcm16: npt.NDArray[np.int16]) -> npt.NDArray[np.uint8]:
    """mu-law octets (uint8, any shape) for 16-bit linear samples (int16, same shape)."""
    _check_dtype(pcm16, "pcm16", np.int16)
    return _ULAW_ENCODE[pcm16.view(np.uint16)]


def ulaw_decode(codes: npt.NDArray[np.uint8]) -> npt.NDArray[np.int16]:
    """16-bit linear samples (int16, -32124..32124) for mu-law octets (uint8, same shape)."""
    _check_dtype(codes, "codes", np.uint8)
    return _ULAW_DECODE[codes]


def alaw_encode(pcm16: npt.NDArray[np.int16]) -> npt.NDArray[np.uint8]:
    """A-law octets (uint8, any shape) for 16-bit linear samples (int16, same shape)."""
    _check_dtype(pcm16, "pcm16", np.int16)
    return _ALAW_ENCODE[pcm16.view(np.uint16)]


def alaw_decode(codes: npt.NDArray[np.uint8]) -> npt.NDArray[np.int16]:
    """16-bit linear samples (int16, -32256..32256) for A-law octets (uint8, same shape)."""
    _check_dtype(codes, "codes", np.uint8)
    return _ALAW_DECODE[codes]
