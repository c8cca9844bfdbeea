"""G.711 codecs: every int16 against a scalar encoder written from the standard's decision tables."""

from __future__ import annotations

import importlib.util
import warnings
from collections.abc import Callable

import numpy as np
import pytest

from voice_server.audio import alaw_decode, alaw_encode, ulaw_decode, ulaw_encode

ALL_PCM16 = np.arange(-32768, 32768, dtype=np.int32).astype(np.int16)
ALL_CODES = np.arange(256, dtype=np.uint8)


def _ulaw_intervals() -> list[tuple[int, int]]:
    """(decision value, width) of the 128 mu-law magnitude intervals on G.711's 14-bit scale (Table 2a).

    Segment s ends at 2**(s+6) - 33 (31, 95, ..., 8159) and holds 16 intervals of width 2**(s+1); the
    first interval of segment 0 is centred on 0 (decision value -1), so it decodes to exactly 0.
    """
    intervals = []
    start = -1
    for segment in range(8):
        width = 2 ** (segment + 1)
        intervals += [(start + k * width, width) for k in range(16)]
        start += 16 * width
    assert start == 8159
    return intervals


def _alaw_intervals() -> list[tuple[int, int]]:
    """(decision value, width) of the 128 A-law magnitude intervals in units of 16 (G.711 Table 1a).

    Segments 0 and 1 have a step of 1 (16 in 16-bit units); segment s >= 2 starts at 2**(s+3) with a
    step of 2**(s-1); the top (segment 7) ends at 2048 (full scale).
    """
    intervals = []
    for segment in range(8):
        start = 0 if segment == 0 else 2 ** (segment + 3)
        width = 1 if segment <= 1 else 2 ** (segment - 1)
        intervals += [(start + k * width, width) for k in range(16)]
    return intervals


ULAW_INTERVALS = _ulaw_intervals()
ALAW_INTERVALS = _alaw_intervals()


def _interval_index(intervals: list[tuple[int, int]], magnitude: int) -> int:
    """The last interval whose decision value is <= magnitude (a plain search, no bit tricks)."""
    index = 0
    for i, (decision, _width) in enumerate(intervals):
        if decision <= magnitude:
            index = i
    return index


def ulaw_encode_scalar(x: int) -> int:
    """One sample: 14-bit value (x >> 2), one's complement magnitude for negatives (the mid-riser
    symmetry of the G.191 reference), the interval search, then the sign and the all-bits inversion."""
    value = x >> 2
    is_negative = value < 0
    magnitude = -value - 1 if is_negative else value
    index = _interval_index(ULAW_INTERVALS, min(magnitude, 8158))
    return (0x7F if is_negative else 0xFF) - index


def alaw_encode_scalar(x: int) -> int:
    """One sample: 12-bit value (x >> 4), one's complement magnitude for negatives, the interval
    search, sign bit 0x80 for non-negative, then the even-bit toggle 0x55."""
    value = x >> 4
    is_negative = value < 0
    magnitude = -value - 1 if is_negative else value
    index = _interval_index(ALAW_INTERVALS, magnitude)
    return (index if is_negative else index | 0x80) ^ 0x55


def ulaw_decode_scalar(code: int) -> int:
    """The interval midpoint (x4 to 16-bit), signed by bit 7 of the inverted octet."""
    index = (~code) & 0x7F
    decision, width = ULAW_INTERVALS[index]
    magnitude = 4 * decision + 2 * width
    return magnitude if code & 0x80 else -magnitude


def alaw_decode_scalar(code: int) -> int:
    index = (code ^ 0x55) & 0x7F
    decision, width = ALAW_INTERVALS[index]
    magnitude = 16 * decision + 8 * width
    return magnitude if code & 0x80 else -magnitude


def test_ulaw_encode_all_int16_match_the_scalar_reference() -> None:
    expected = np.array([ulaw_encode_scalar(int(x)) for x in ALL_PCM16], dtype=np.uint8)
    got = ulaw_encode(ALL_PCM16)
    assert got.dtype == np.uint8
    np.testing.assert_array_equal(got, expected)


def test_alaw_encode_all_int16_match_the_scalar_reference() -> None:
    expected = np.array([alaw_encode_scalar(int(x)) for x in ALL_PCM16], dtype=np.uint8)
    got = alaw_encode(ALL_PCM16)
    assert got.dtype == np.uint8
    np.testing.assert_array_equal(got, expected)


def test_decode_tables_match_the_scalar_reference() -> None:
    np.testing.assert_array_equal(ulaw_decode(ALL_CODES), [ulaw_decode_scalar(int(c)) for c in ALL_CODES])
    np.testing.assert_array_equal(alaw_decode(ALL_CODES), [alaw_decode_scalar(int(c)) for c in ALL_CODES])
    assert ulaw_decode(ALL_CODES).dtype == np.int16 and alaw_decode(ALL_CODES).dtype == np.int16


@pytest.mark.parametrize(
    ("x", "ulaw", "alaw"),
    [
        (0, 0xFF, 0xD5),
        (-1, 0x7F, 0x55),
        (32767, 0x80, 0xAA),
        (-32768, 0x00, 0x2A),
        (3, 0xFF, 0xD5),  # below the first mu-law decision value (4 in 16-bit units)
        (4, 0xFE, 0xD5),
        (-4, 0x7F, 0x55),  # one's complement: -4 is 3 in magnitude, still the zero interval
        (-5, 0x7E, 0x55),
        (16, 0xFD, 0xD4),  # mu-law: 14-bit 4 is in [3, 5), interval 2; A-law: the first step
        (-17, 0x7D, 0x54),
    ],
)
def test_known_vectors(x: int, ulaw: int, alaw: int) -> None:
    pcm = np.array([x], dtype=np.int16)
    assert int(ulaw_encode(pcm)[0]) == ulaw
    assert int(alaw_encode(pcm)[0]) == alaw


def test_known_decode_values() -> None:
    codes = np.array([0x00, 0x7F, 0x80, 0xFF], dtype=np.uint8)
    np.testing.assert_array_equal(ulaw_decode(codes), [-32124, 0, 32124, 0])
    codes = np.array([0xD5, 0x55, 0xAA, 0x2A], dtype=np.uint8)
    np.testing.assert_array_equal(alaw_decode(codes), [8, -8, 32256, -32256])


@pytest.mark.parametrize(("encode", "decode"), [(ulaw_encode, ulaw_decode), (alaw_encode, alaw_decode)])
def test_round_trip_properties(
    encode: Callable[[np.ndarray], np.ndarray], decode: Callable[[np.ndarray], np.ndarray]
) -> None:
    # encode(decode(c)) == c for every code except mu-law's negative zero (0x7F decodes to 0 = 0xFF).
    codes = encode(decode(ALL_CODES))
    mismatched = ALL_CODES[codes != ALL_CODES]
    assert set(mismatched.tolist()) <= {0x7F}
    # decode(encode(x)) is monotone non-decreasing in x, idempotent, and within half a step of x.
    decoded = decode(encode(ALL_PCM16)).astype(np.int32)
    assert np.all(np.diff(decoded) >= 0)
    np.testing.assert_array_equal(decode(encode(decoded.astype(np.int16))), decoded)
    error = np.abs(decoded - ALL_PCM16.astype(np.int32))
    relative = error / np.maximum(np.abs(ALL_PCM16.astype(np.int32)), 256)
    assert relative.max() < 0.07  # log companding: ~3% of the magnitude away from the smallest steps


def test_any_shape_and_strided_input() -> None:
    pcm = ALL_PCM16[::7].reshape(-1, 1)[:9000].reshape(3, 3000)
    assert ulaw_encode(pcm).shape == (3, 3000)
    np.testing.assert_array_equal(alaw_encode(ALL_PCM16[::-3]), alaw_encode(ALL_PCM16[::-3].copy()))
    assert ulaw_decode(np.zeros(0, dtype=np.uint8)).shape == (0,)


def test_wrong_dtype_names_the_argument() -> None:
    with pytest.raises(ValueError, match="pcm16 must be a numpy array of int16, got float32"):
        ulaw_encode(np.zeros(3, dtype=np.float32))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="codes must be a numpy array of uint8, got int16"):
        alaw_decode(np.zeros(3, dtype=np.int16))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="pcm16 .* got bytes"):
        alaw_encode(b"\x00\x00")  # type: ignore[arg-type]


HAS_AUDIOOP = importlib.util.find_spec("audioop") is not None


@pytest.mark.environment
@pytest.mark.skipif(not HAS_AUDIOOP, reason="environment: this Python has no audioop (removed in 3.13)")
def test_cross_check_with_audioop() -> None:
    """A second oracle where one exists: audioop's A-law equals ours everywhere; its mu-law (Sun's encoder,
    which negates negatives instead of complementing them) equals ours for x >= 0 and equals ours at
    x - 4 for x < 0; all decode tables are equal."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        import audioop
    raw = ALL_PCM16.tobytes()
    np.testing.assert_array_equal(np.frombuffer(audioop.lin2alaw(raw, 2), np.uint8), alaw_encode(ALL_PCM16))
    theirs = np.frombuffer(audioop.lin2ulaw(raw, 2), np.uint8)
    shifted = np.where(ALL_PCM16 < 0, np.maximum(ALL_PCM16.astype(np.int32) - 4, -32768), ALL_PCM16)
    np.testing.assert_array_equal(theirs, ulaw_encode(shifted.astype(np.int16)))
    num_differ = int(np.count_nonzero(theirs != ulaw_encode(ALL_PCM16)))
    assert 0 < num_differ < 600  # only negative samples on a decision value
    codes = ALL_CODES.tobytes()
    np.testing.assert_array_equal(np.frombuffer(audioop.ulaw2lin(codes, 2), np.int16), ulaw_decode(ALL_CODES))
    np.testing.assert_array_equal(np.frombuffer(audioop.alaw2lin(codes, 2), np.int16), alaw_decode(ALL_CODES))
