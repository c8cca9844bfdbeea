"""Image preprocessing of the Qwen3-Omni vision tower (numpy + PIL, no torch): decode, resize, normalise, patchify.

Equal to transformers' PIL Qwen2-VL image processor (`Qwen2VLImageProcessorPil`, the "pil" backend that
`AutoImageProcessor` maps `qwen3_omni_moe` to) configured with the released `preprocessor_config.json`:
the same `smart_resize` grid, PIL bicubic resize of the uint8 RGB image, float64 rescale cast to float32,
float32 normalisation, and the same patch order. An image becomes `temporal_patch_size` identical frames.

Defaults of `VisionPreprocessConfig` and where they come from:
- patch_size 16, temporal_patch_size 2, merge_size 2, min_pixels 3136, max_pixels 12845056, image_mean and
  image_std 0.5: the released Qwen3-Omni-30B-A3B `preprocessor_config.json` (the same in the Instruct,
  Thinking and Captioner repos; there is no `video_preprocessor_config.json`, so transformers' video
  processor reads this file too). NOTE: transformers' class defaults differ (patch 14, CLIP mean/std).
- rescale_factor 1/255: transformers' image processor default (the released file does not set it).
- video_min_pixels 128*32*32, video_max_pixels 768*32*32: `Qwen3OmniMoeProcessor.videos_kwargs["size"]`
  (transformers 5.24), which the processor passes on every video call, overriding the file's pixel limits.
- video_fps 2.0: qwen-omni-utils / qwen-vl-utils `FPS` (transformers' processor samples no frames by
  default; Qwen's own pipeline samples at 2 fps before calling it).
- video_min_frames 4, video_max_frames 768: `Qwen2VLVideoProcessor.min_frames / max_frames` (equal to
  qwen-vl-utils `FPS_MIN_FRAMES / FPS_MAX_FRAMES`).
- max_decoded_pixels 2**26: ours, a decompression-bomb guard (a 48 MP photo passes; PIL's own limit,
  about 89 M pixels for a warning and twice that for an error, stays on as a second line).
"""

from __future__ import annotations

import io
import math
import warnings
from dataclasses import dataclass

import numpy as np
from PIL import Image, ImageOps

from voice_server.models.hf_config import check_positive

# NOTE: smart_resize's hard-coded limit in transformers and qwen-vl-utils.
MAX_ASPECT_RATIO = 200
# Encoded formats we decode (PIL's names). Restricting them keeps PIL's rarer, less-hardened decoders out.
IMAGE_FORMATS = ("PNG", "JPEG", "WEBP", "GIF", "BMP")


@dataclass(frozen=True)
class VisionPreprocessConfig:
    patch_size: int = 16  # pixels per patch side
    temporal_patch_size: int = 2  # frames per patch
    merge_size: int = 2  # merge x merge patches become one LLM token
    min_pixels: int = 56 * 56  # image pixel budget after resizing (3136)
    max_pixels: int = 28 * 28 * 16384  # 12845056
    image_mean: tuple[float, float, float] = (0.5, 0.5, 0.5)
    image_std: tuple[float, float, float] = (0.5, 0.5, 0.5)
    rescale_factor: float = 1 / 255
    video_min_pixels: int = 128 * 32 * 32  # per-frame pixel budget of videos
    video_max_pixels: int = 768 * 32 * 32
    video_fps: float = 2.0  # frames sampled per second of video
    video_min_frames: int = 4
    video_max_frames: int = 768
    max_decoded_pixels: int = 2**26  # refuse larger images (and video frames) before decoding them

    def __post_init__(self) -> None:
        check_positive(
            self, "patch_size", "temporal_patch_size", "merge_size", "min_pixels", "max_pixels", "video_min_pixels",
            "video_max_pixels", "video_min_frames", "video_max_frames", "max_decoded_pixels", integer=True,
        )
        check_positive(self, "rescale_factor", "video_fps")
        name = type(self).__name__
        for lo, hi in (("min_pixels", "max_pixels"), ("video_min_pixels", "video_max_pixels"),
                       ("video_min_frames", "video_max_frames")):
            if getattr(self, lo) > getattr(self, hi):
                raise ValueError(f"{name}.{lo}={getattr(self, lo)} is above {hi}={getattr(self, hi)}")
        if self.video_max_frames < self.temporal_patch_size:
            raise ValueError(
                f"{name}.video_max_frames={self.video_max_frames} is below "
                f"temporal_patch_size={self.temporal_patch_size}"
            )
        for field in ("image_mean", "image_std"):
            values = getattr(self, field)
            if len(values) != 3 or not all(isinstance(v, int | float) and math.isfinite(v) for v in values):
                raise ValueError(f"{name}.{field} must be 3 finite numbers (R, G, B), got {values!r}")
        if any(v <= 0 for v in self.image_std):
            raise ValueError(f"{name}.image_std must be > 0, got {self.image_std!r}")
        for field in ("rescale_factor", "video_fps"):
            if not math.isfinite(getattr(self, field)):
                raise ValueError(f"{name}.{field} must be finite, got {getattr(self, field)!r}")

    @property
    def factor(self) -> int:
        """Resized sides are multiples of this: one merge block of patches."""
        return self.patch_size * self.merge_size

    @property
    def patch_dim(self) -> int:
        """Values per row of `pixel_values`: 3 channels * temporal_patch_size * patch_size**2."""
        return 3 * self.temporal_patch_size * self.patch_size**2


@dataclass(frozen=True)
class ImagePatches:
    pixel_values: np.ndarray  # [num_patches, patch_dim] float32, in the processor's patch order
    grid_thw: tuple[int, int, int]  # (temporal patches, patch rows, patch columns)

    @property
    def num_patches(self) -> int:
        return self.pixel_values.shape[0]

    def num_tokens(self, merge_size: int) -> int:
        """LLM placeholder tokens: one per merge x merge block."""
        t, h, w = self.grid_thw
        return t * h * w // merge_size**2


def smart_resize(height: int, width: int, factor: int, min_pixels: int, max_pixels: int) -> tuple[int, int]:
    """The Qwen2-VL resize rule: sides become multiples of `factor`, the area lands in [min_pixels,
    max_pixels] where the rounding allows, the aspect ratio is kept as far as it can be."""
    if height <= 0 or width <= 0:
        raise ValueError(f"image must be at least 1x1 pixels, got {height}x{width} (height x width)")
    if max(height, width) / min(height, width) > MAX_ASPECT_RATIO:
        raise ValueError(
            f"image aspect ratio {max(height, width) / min(height, width):.1f} ({height}x{width}) is above "
            f"{MAX_ASPECT_RATIO}"
        )
    # NOTE: Python's round (half to even), as transformers uses.
    h_bar, w_bar = round(height / factor) * factor, round(width / factor) * factor
    if h_bar * w_bar > max_pixels:
        beta = math.sqrt((height * width) / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


def _check_size(height: int, width: int, config: VisionPreprocessConfig) -> None:
    if height * width > config.max_decoded_pixels:
        raise ValueError(
            f"image is too large: {height}x{width} = {height * width} pixels, above the limit of "
            f"{config.max_decoded_pixels}"
        )


def _pil_to_rgb(image: Image.Image) -> np.ndarray:
    """HWC uint8 RGB; transparency is composited onto white (transformers' `convert_to_rgb` for PIL)."""
    if "A" in image.getbands() or image.info.get("transparency") is not None:
        rgba = image.convert("RGBA")
        white = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return np.asarray(Image.alpha_composite(white, rgba).convert("RGB"))
    return np.asarray(image.convert("RGB"))


def _array_to_rgb(array: np.ndarray) -> np.ndarray:
    """HWC uint8 RGB from HW / HWC (C = 1, 3, 4) uint8, as transformers' `convert_to_rgb` does for arrays."""
    if array.ndim == 2:
        array = array[:, :, None]
    channels = array.shape[2]
    if channels == 1:
        return np.repeat(array, 3, axis=2)
    if channels == 4:
        # NOTE: float64 blend and round half to even, not PIL's alpha_composite (which rounds differently).
        alpha = array[:, :, 3:4] / 255
        return np.round(alpha * array[:, :, :3] + (1 - alpha) * 255).astype(np.uint8)
    return array


def decode_image(image: bytes | bytearray | memoryview | np.ndarray, config: VisionPreprocessConfig) -> np.ndarray:
    """Encoded image bytes (PNG, JPEG, WEBP, GIF, BMP; the first frame of an animation) or an HW / HWC
    uint8 array (C = 1, 3 or 4) -> HWC uint8 RGB. The EXIF orientation of encoded images is applied (as
    transformers' `load_image` does). Raises ValueError saying what is wrong with the input."""
    if isinstance(image, np.ndarray):
        if image.dtype != np.uint8:
            raise ValueError(f"image array must be uint8, got {image.dtype}")
        if image.ndim not in (2, 3) or (image.ndim == 3 and image.shape[2] not in (1, 3, 4)):
            raise ValueError(f"image array must be HxW or HxWxC with C in (1, 3, 4), got shape {image.shape}")
        if image.shape[0] == 0 or image.shape[1] == 0:
            raise ValueError(f"image array is empty, shape {image.shape}")
        _check_size(image.shape[0], image.shape[1], config)
        return np.ascontiguousarray(_array_to_rgb(image))
    if not isinstance(image, bytes | bytearray | memoryview):
        raise ValueError(f"image must be encoded bytes or a uint8 array, got {type(image).__name__}")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            # NOTE: open reads the header only, so the size check below runs before any pixel is decoded.
            pil = Image.open(io.BytesIO(bytes(image)), formats=IMAGE_FORMATS)
    except (Image.DecompressionBombError, Image.DecompressionBombWarning) as e:
        raise ValueError(f"image is too large: {e}") from e
    except Exception as e:  # PIL raises many types (OSError, SyntaxError, struct.error) for corrupt data
        raise ValueError(f"not a decodable image ({', '.join(IMAGE_FORMATS)}): {e}") from e
    with pil:
        _check_size(pil.height, pil.width, config)
        try:
            return _pil_to_rgb(ImageOps.exif_transpose(pil))
        except Exception as e:
            raise ValueError(f"corrupt {pil.format} image: {e}") from e


def resize_and_normalize(rgb: np.ndarray, height: int, width: int, config: VisionPreprocessConfig) -> np.ndarray:
    """HWC uint8 RGB -> CHW float32 at (height, width): PIL bicubic, then (x / 255 - mean) / std."""
    resized = np.asarray(Image.fromarray(rgb).resize((width, height), Image.Resampling.BICUBIC))
    # NOTE: rescale in float64 then cast, normalise in float32: transformers' order, so the bits match.
    scaled = (resized.astype(np.float64) * config.rescale_factor).astype(np.float32)
    mean = np.asarray(config.image_mean, dtype=np.float32)
    std = np.asarray(config.image_std, dtype=np.float32)
    return np.ascontiguousarray(((scaled - mean) / std).transpose(2, 0, 1))


def patchify(frames: np.ndarray, config: VisionPreprocessConfig) -> tuple[np.ndarray, tuple[int, int, int]]:
    """[num_frames, C, H, W] float32 (num_frames a multiple of temporal_patch_size, H and W of `factor`)
    -> pixel_values [grid_t * grid_h * grid_w, C * T * P * P] and grid_thw.

    Patch order: frame group, then merge block (raster), then patch inside the block (raster); a row
    holds channel, frame, patch row, patch column (transformers' Qwen2-VL permute)."""
    num_frames, channels, height, width = frames.shape
    p, m, t = config.patch_size, config.merge_size, config.temporal_patch_size
    if num_frames % t or height % (p * m) or width % (p * m):
        raise ValueError(f"frames {frames.shape} do not tile into {t}x{p * m}x{p * m} blocks")
    grid_t, grid_h, grid_w = num_frames // t, height // p, width // p
    patches = frames.reshape(grid_t, t, channels, grid_h // m, m, p, grid_w // m, m, p)
    patches = patches.transpose(0, 3, 6, 4, 7, 2, 1, 5, 8)
    return patches.reshape(grid_t * grid_h * grid_w, channels * t * p * p), (grid_t, grid_h, grid_w)


def preprocess_image(
    image: bytes | bytearray | memoryview | np.ndarray, config: VisionPreprocessConfig | None = None
) -> ImagePatches:
    """Encoded bytes or an HW / HWC uint8 array -> the vision tower's pixel_values and grid_thw."""
    config = config or VisionPreprocessConfig()
    rgb = decode_image(image, config)
    height, width = smart_resize(rgb.shape[0], rgb.shape[1], config.factor, config.min_pixels, config.max_pixels)
    chw = resize_and_normalize(rgb, height, width, config)
    # NOTE: the image stands for temporal_patch_size identical frames (a broadcast: no copy until the reshape).
    frames = np.broadcast_to(chw[None], (config.temporal_patch_size, *chw.shape))
    pixel_values, grid_thw = patchify(frames, config)
    return ImagePatches(pixel_values=pixel_values, grid_thw=grid_thw)
