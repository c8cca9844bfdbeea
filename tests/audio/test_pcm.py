"""PCM16 byte/array/float conversions and strict base64."""

from __future__ import annotations

import base64

import numpy as np
import pytest

from voice_server.audio import (
    b64decode,
    b64encode,
    float32_to_pcm16,
    pcm16_from_bytes,
    pcm16_to_bytes,
    pcm16_to_float32,
)

ALL_PCM16 = np.arange(-32768, 32768, dtype=np.int32).astype(np.int16)


def test_bytes_are_little_endian_and_round_trip() -> None:
    samples = pcm16_from_bytes(b"\x01\x00\xff\xff\x00\x80\xff\x7f")
    assert samples.dtype == np.int16 and samples.flags.writeable
    np.testing.assert_array_equal(samples, [1, -1, -32768, 32767])
    assert pcm16_to_bytes(samples) == b"\x01\x00\xff\xff\x00\x80\xff\x7f"
    assert pcm16_to_bytes(pcm16_from_bytes(ALL_PCM16.tobytes())) == ALL_PCM16.astype("<i2").tobytes()
    assert pcm16_from_bytes(b"").shape == (0,)
    np.testing.assert_array_equal(pcm16_from_bytes(memoryview(b"\x02\x00")), [2])


def test_odd_byte_count_is_refused() -> None:
    with pytest.raises(ValueError, match=r"data must hold whole 16-bit samples, got an odd byte count \(3\)"):
        pcm16_from_bytes(b"\x00\x00\x00")


def test_pcm16_to_bytes_refuses_other_dtypes() -> None:
    with pytest.raises(ValueError, match="samples must be a numpy int16 array, got float32"):
        pcm16_to_bytes(np.zeros(2, dtype=np.float32))  # type: ignore[arg-type]


def test_int16_float32_round_trip_is_exact() -> None:
    as_float = pcm16_to_float32(ALL_PCM16)
    assert as_float.dtype == np.float32
    assert as_float.min() == -1.0 and as_float.max() == np.float32(32767 / 32768) and as_float.max() < 1.0
    np.testing.assert_array_equal(float32_to_pcm16(as_float), ALL_PCM16)


def test_float_to_int16_rounds_half_to_even_and_clips() -> None:
    x = np.array([0.5, 1.5, 2.5, -0.5, -1.5, 0.49, 40000.0, -40000.0, 32767.5], dtype=np.float32) / 32768
    np.testing.assert_array_equal(float32_to_pcm16(x), [0, 2, 2, 0, -2, 0, 32767, -32768, 32767])
    np.testing.assert_array_equal(float32_to_pcm16(np.array([1.0, -1.0, 2.0, -2.0])), [32767, -32768, 32767, -32768])
    assert float32_to_pcm16(np.zeros((2, 3), dtype=np.float64)).shape == (2, 3)


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_non_finite_floats_are_refused(bad: float) -> None:
    x = np.array([0.0, bad, 0.1], dtype=np.float32)
    with pytest.raises(ValueError, match=r"samples holds 1 non-finite value\(s\)"):
        float32_to_pcm16(x)


def test_float_to_int16_refuses_integers() -> None:
    with pytest.raises(ValueError, match="samples must be a numpy float array, got int16"):
        float32_to_pcm16(ALL_PCM16)  # type: ignore[arg-type]


def test_base64_round_trip_and_standard_alphabet() -> None:
    data = bytes(range(256))
    text = b64encode(data)
    assert isinstance(text, str) and text == base64.b64encode(data).decode()
    assert b64decode(text) == data and b64decode(text.encode()) == data
    assert b64decode("") == b""


@pytest.mark.parametrize(
    "payload",
    [
        "AAE",  # bad padding
        "AA E=",  # whitespace
        "AAE=\n",  # a trailing newline
        "AA-_",  # the URL-safe alphabet
        "AA*=",  # not base64 at all
        "AAé=",  # not ASCII
    ],
)
def test_invalid_base64_is_refused_naming_the_problem(payload: str) -> None:
    # NOTE: the reason in parentheses is binascii's, whose wording differs between Python versions.
    with pytest.raises(ValueError, match=r"payload is not valid base64 \(.+\); length \d+") as caught:
        b64decode(payload)
    assert caught.value.__cause__ is not None


def test_b64decode_refuses_other_types() -> None:
    with pytest.raises(ValueError, match="payload must be str or bytes, got int"):
        b64decode(3)  # type: ignore[arg-type]
