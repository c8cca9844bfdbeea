"""Images for the tests: random uint8 pixels, encoded PNG/JPEG bytes and data URLs (what clients send)."""

from __future__ import annotations

import base64
import io

import numpy as np
from PIL import Image


def pixels(shape: tuple[int, ...], seed: int) -> np.ndarray:
    """Random uint8 pixels of `shape` (H x W or H x W x C; T x H x W x C for video frames)."""
    return np.random.default_rng(seed).integers(0, 256, shape, dtype=np.uint8)


def png(array: np.ndarray) -> bytes:
    return encoded(Image.fromarray(array), "PNG")


def encoded(image: Image.Image, fmt: str) -> bytes:
    out = io.BytesIO()
    image.save(out, format=fmt)
    return out.getvalue()


def flat(fmt: str, size: tuple[int, int] = (37, 21), color: tuple[int, int, int] = (200, 30, 60)) -> bytes:
    """An image of one colour, `size` (width, height), encoded as `fmt` (PNG, JPEG, GIF...)."""
    return encoded(Image.new("RGB", size, color), fmt)


def data_url(data: bytes, mime: str = "image/png") -> str:
    return f"data:{mime};base64,{base64.b64encode(data).decode()}"
