"""Images a client sends into the conversation (`/v1/realtime` `input_image` parts, `/ws` `image` messages).

Checked here, when the item arrives, rather than at the encoder stage when a response runs: a bad image is
then the client's error event on its own message, not a failed response later. Only the header is read
(PIL opens lazily: the format and size, no pixel decoding in the server's event loop); the encoder stage
decodes and preprocesses it as the model's processor does (`voice_server/models/qwen3_omni/vision/preprocess.py`).

Formats are OpenAI's: PNG and JPEG. An image item is at most `MAX_IMAGE_BYTES` encoded and `MAX_IMAGE_PIXELS`
in size (a 48 MP photo passes; a decompression bomb's header does not).
"""

from __future__ import annotations

import io
from dataclasses import dataclass

from PIL import Image, UnidentifiedImageError

from voice_server.audio import b64decode

__all__ = ["FORMATS", "MAX_IMAGE_BYTES", "MAX_IMAGE_PIXELS", "MAX_IMAGES", "ImageInfo", "check_image",
           "parse_data_url"]

FORMATS = {"PNG": "image/png", "JPEG": "image/jpeg"}
MAX_IMAGE_BYTES = 10 * 1024 * 1024
MAX_IMAGE_PIXELS = 1 << 26
"""The encoder stage's own limit before decoding (`vision/preprocess.py`): ~67 MP."""
MAX_IMAGES = 8
"""Images in one message: each becomes up to ~16k thinker tokens at the processor's largest size."""


@dataclass(frozen=True)
class ImageInfo:
    mime_type: str
    width: int
    height: int


def parse_data_url(url: str) -> bytes:
    """`data:image/png;base64,...` (or image/jpeg) -> the image's bytes; ValueError saying what is wrong."""
    head, comma, payload = url.partition(",")
    if not head.startswith("data:") or not comma:
        raise ValueError("must be a data URL (data:image/png;base64,...); remote URLs are not fetched")
    mime, _, encoding = head[len("data:"):].partition(";")
    if mime not in FORMATS.values() or encoding != "base64":
        raise ValueError(f"must be a base64 PNG or JPEG data URL (image/png or image/jpeg), got {head[:40]!r}")
    if len(payload) // 4 * 3 > MAX_IMAGE_BYTES + 2:
        raise ValueError(f"the image is over {MAX_IMAGE_BYTES} bytes")
    try:
        return b64decode(payload)
    except ValueError as exc:
        raise ValueError(f"its base64 is invalid ({exc})") from exc


def check_image(data: bytes) -> ImageInfo:
    """The format and size of an encoded image; ValueError for anything that is not a PNG or JPEG within the
    limits (the header is read, the pixels are not)."""
    if not data:
        raise ValueError("the image is empty")
    if len(data) > MAX_IMAGE_BYTES:
        raise ValueError(f"the image is {len(data)} bytes, over the {MAX_IMAGE_BYTES}-byte limit")
    try:
        with Image.open(io.BytesIO(data)) as image:
            fmt, (width, height) = image.format, image.size
    except Image.DecompressionBombError as exc:  # NOTE: PIL's own limit, checked from the header too
        raise ValueError(f"the image is over {MAX_IMAGE_PIXELS} pixels") from exc
    except (UnidentifiedImageError, OSError) as exc:
        raise ValueError(f"not a readable image ({type(exc).__name__})") from exc
    if fmt not in FORMATS:
        raise ValueError(f"must be PNG or JPEG, got {fmt}")
    if width < 1 or height < 1 or width * height > MAX_IMAGE_PIXELS:
        raise ValueError(f"{width}x{height} pixels is outside 1 to {MAX_IMAGE_PIXELS} pixels")
    return ImageInfo(FORMATS[fmt], width, height)
