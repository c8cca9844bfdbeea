"""Vision preprocessing vs transformers: the PIL Qwen2-VL image processor, and the video processor's own code.

Images: compared with `Qwen2VLImageProcessorPil` (what `AutoImageProcessor` maps `qwen3_omni_moe` to for
the PIL backend) built with the released preprocessor_config values; pixel_values must be bit-identical.

Video: transformers' `Qwen2VLVideoProcessor` module imports torchvision, which this environment cannot
load, so the reference is assembled from the installed sources:
- `sample_frames` and `patchify` are transformers' own code: their `def`s are cut out of the installed
  `video_processing_qwen2_vl.py` with `ast` and executed on a stub `self` (they use only torch and math);
  `min_frames` / `max_frames` are read from the same class body, the video `size` from the processor class;
- `smart_resize` is transformers' (the PIL module's copy of the same function);
- the resize re-derives torchvision's `resize_image` for uint8 bicubic on CPU (its source sends uint8
  straight to `torch.nn.functional.interpolate(..., antialias=True)`), and the normalisation re-derives
  `TorchvisionBackend.rescale_and_normalize` (mean and std scaled by 1 / rescale_factor, float32).
Two deliberate departures, both asserted: transformers' `torch.arange(0, n, n / k)` sometimes yields a
(k+1)-th index equal to n (past the clip: an IndexError there), which the comparison drops; a clip shorter
than one temporal patch makes it divide by zero, where ours keeps every frame and pads (what transformers
does for unsampled videos, its default). The video output must be bit-identical to this reference.
Frame-by-frame, the video frames are also compared with the image path (PIL bicubic), within two levels.
Seconds per temporal patch: equal to the processor's `temporal_patch_size / fps` when sampling is not
clamped, and put through `get_rope_index`'s time formula (x position_id_per_seconds).
"""

from __future__ import annotations

import ast
import functools
import io
import math
import struct
import types
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import transformers
from PIL import Image
from transformers.image_utils import load_image
from transformers.models.auto.image_processing_auto import IMAGE_PROCESSOR_MAPPING_NAMES
from transformers.models.qwen2_vl import image_processing_pil_qwen2_vl as hf_pil

from voice_server.models.qwen3_omni.vision.preprocess import (
    VisionPreprocessConfig,
    decode_image,
    preprocess_image,
    resize_and_normalize,
    smart_resize,
)
from voice_server.models.qwen3_omni.vision.video import (
    preprocess_video,
    resize_and_normalize_frames,
    sample_frame_indices,
)

CFG = VisionPreprocessConfig()
RELEASED = dict(patch_size=16, temporal_patch_size=2, merge_size=2, min_pixels=3136, max_pixels=12845056,
                image_mean=[0.5, 0.5, 0.5], image_std=[0.5, 0.5, 0.5])  # Qwen3-Omni preprocessor_config.json


def _hf_image(image: Any, **overrides: Any) -> tuple[np.ndarray, tuple[int, ...]]:
    out = hf_pil.Qwen2VLImageProcessorPil(**{**RELEASED, **overrides})(images=[image], return_tensors="np")
    return out["pixel_values"], tuple(int(v) for v in out["image_grid_thw"][0])


def _noise(shape: tuple[int, ...], seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, shape, dtype=np.uint8)


def _encode(image: Image.Image, fmt: str, **kwargs: Any) -> bytes:
    buf = io.BytesIO()
    image.save(buf, fmt, **kwargs)
    return buf.getvalue()


def _assert_same_as_hf(ours: Any, ref: tuple[np.ndarray, tuple[int, ...]]) -> None:
    assert ours.grid_thw == ref[1]
    assert ours.pixel_values.dtype == np.float32 and ours.pixel_values.shape == ref[0].shape
    np.testing.assert_array_equal(ours.pixel_values, ref[0])  # bit-identical


# --- the released setup -------------------------------------------------------------------------------


def test_defaults_are_the_released_processor_values() -> None:
    assert IMAGE_PROCESSOR_MAPPING_NAMES["qwen3_omni_moe"]["pil"] == "Qwen2VLImageProcessorPil"
    # NOTE: without torchvision the auto module blanks its video entries at import, so read its source.
    video_auto = Path(transformers.__file__).parent / "models" / "auto" / "video_processing_auto.py"
    assert '("qwen3_omni_moe", {"torchvision": "Qwen2VLVideoProcessor"})' in video_auto.read_text()
    processor = transformers.Qwen3OmniMoeProcessor
    assert getattr(processor, "images_kwargs", {}) == {}  # images use preprocessor_config.json as is
    video_size = processor.videos_kwargs["size"]
    assert (CFG.video_min_pixels, CFG.video_max_pixels) == (video_size["shortest_edge"], video_size["longest_edge"])
    assert (CFG.video_min_frames, CFG.video_max_frames) == (_hf_video_attr("min_frames"), _hf_video_attr("max_frames"))
    assert (CFG.patch_size, CFG.temporal_patch_size, CFG.merge_size) == (16, 2, 2)
    assert (CFG.min_pixels, CFG.max_pixels, CFG.image_mean, CFG.image_std) == (3136, 12845056, (0.5,) * 3, (0.5,) * 3)
    assert CFG.rescale_factor == hf_pil.Qwen2VLImageProcessorPil().rescale_factor


@pytest.mark.parametrize("limits", [(3136, 12845056), (131072, 786432), (50_000, 60_000)])
def test_smart_resize_equals_transformers(limits: tuple[int, int]) -> None:
    sides = [1, 2, 15, 16, 17, 31, 32, 33, 47, 48, 49, 63, 64, 100, 255, 257, 511, 513, 1000, 1920, 4095, 5000]
    for h in sides:
        for w in sides:
            if max(h, w) / min(h, w) > 200:
                with pytest.raises(ValueError, match="aspect ratio"):
                    smart_resize(h, w, 32, *limits)
                with pytest.raises(ValueError):
                    hf_pil.smart_resize(h, w, 32, *limits)
            else:
                assert smart_resize(h, w, 32, *limits) == hf_pil.smart_resize(h, w, 32, *limits), (h, w)


# --- images ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "shape", [(37, 901), (901, 37), (1, 1), (1, 200), (513, 257), (10, 12), (64, 96), (480, 640), (199, 1)]
)
def test_rgb_image_equals_pil_processor(shape: tuple[int, int]) -> None:
    rgb = _noise((*shape, 3), seed=sum(shape))
    _assert_same_as_hf(preprocess_image(rgb), _hf_image(Image.fromarray(rgb)))


def test_downscale_branch_equals_pil_processor() -> None:
    rgb = _noise((700, 901, 3), seed=1)
    config = VisionPreprocessConfig(min_pixels=1024, max_pixels=50_000)
    ours = preprocess_image(_encode(Image.fromarray(rgb), "PNG"), config)
    _assert_same_as_hf(ours, _hf_image(Image.fromarray(rgb), min_pixels=1024, max_pixels=50_000))
    assert ours.grid_thw == (1, 12, 14) and ours.num_tokens(CFG.merge_size) == 42


def test_image_above_released_max_pixels_equals_pil_processor() -> None:
    rgb = _noise((2900, 4530, 3), seed=2)  # 13.1 M pixels > 12845056
    ours = preprocess_image(rgb)
    _assert_same_as_hf(ours, _hf_image(Image.fromarray(rgb)))
    t, h, w = ours.grid_thw
    assert t == 1 and h * w * 16 * 16 <= CFG.max_pixels


def _rgba(shape: tuple[int, int], seed: int) -> np.ndarray:
    rgba = _noise((*shape, 4), seed)
    rgba[: shape[0] // 3, :, 3] = 0  # fully transparent band
    rgba[-shape[0] // 3 :, :, 3] = 255  # opaque band
    return rgba


def _encoded_cases() -> dict[str, bytes]:
    grey = Image.fromarray(_noise((75, 121), 3), mode="L")
    palette = Image.fromarray(_noise((41, 77, 3), 4)).quantize(16)
    palette.info["transparency"] = 5
    return {
        "rgba_png": _encode(Image.fromarray(_rgba((63, 129), 5), mode="RGBA"), "PNG"),
        "grey_jpeg": _encode(grey, "JPEG", quality=90),
        "rgb_jpeg": _encode(Image.fromarray(_noise((101, 67, 3), 4)), "JPEG", quality=85),
        "palette_transparency_png": _encode(palette, "PNG", transparency=5),
        "la_png": _encode(Image.fromarray(_noise((50, 300, 2), 6), mode="LA"), "PNG"),
        "cmyk_jpeg": _encode(Image.fromarray(_noise((40, 60, 4), 7), mode="CMYK"), "JPEG"),
        "rgb_gif": _encode(Image.fromarray(_noise((33, 47, 3), 8)), "GIF"),
    }


@pytest.mark.parametrize("name", list(_encoded_cases()))
def test_encoded_image_equals_pil_processor(name: str) -> None:
    data = _encoded_cases()[name]
    _assert_same_as_hf(preprocess_image(data), _hf_image(Image.open(io.BytesIO(data))))


@pytest.mark.parametrize("channels", [1, 4])
def test_array_conversion_equals_processor_numpy_path(channels: int) -> None:
    array = _rgba((53, 95), 9) if channels == 4 else _noise((53, 95, 1), 9)
    ref = _hf_image(array, input_data_format="channels_last")  # transformers' array branch of convert_to_rgb
    _assert_same_as_hf(preprocess_image(array), ref)
    if channels == 1:
        np.testing.assert_array_equal(preprocess_image(array[:, :, 0]).pixel_values, ref[0])


def test_exif_orientation_is_applied_like_load_image(tmp_path: Path) -> None:
    exif = Image.Exif()
    exif[0x0112] = 6  # rotate 90 degrees clockwise to display
    data = _encode(Image.fromarray(_noise((40, 100, 3), 10)), "JPEG", exif=exif.tobytes())
    (tmp_path / "photo.jpg").write_bytes(data)
    ours = preprocess_image(data)
    _assert_same_as_hf(ours, _hf_image(load_image(str(tmp_path / "photo.jpg"))))
    assert decode_image(data, CFG).shape == (100, 40, 3)


def _png_header(width: int, height: int) -> bytes:
    """A PNG whose header claims width x height RGB pixels, with (almost) no pixel data behind it."""
    def chunk(kind: bytes, payload: bytes) -> bytes:
        return struct.pack(">I", len(payload)) + kind + payload + struct.pack(">I", zlib.crc32(kind + payload))
    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(b"\0" * 64)) + chunk(b"IEND", b"")


@pytest.mark.parametrize(
    ("image", "message"),
    [
        (b"hello", "not a decodable image"),
        (b"", "not a decodable image"),
        (_encode(Image.fromarray(_noise((8, 8, 3), 0)), "TIFF"), "not a decodable image"),
        (_encode(Image.fromarray(_noise((64, 64, 3), 0)), "PNG")[:200], "corrupt PNG"),
        (_png_header(9000, 9000), "too large: 9000x9000"),  # ours, before PIL's limit
        (_png_header(20000, 20000), "too large"),  # PIL's decompression-bomb error
        (np.zeros((1, 201, 3), np.uint8), "aspect ratio"),
        (np.zeros((8, 8, 3), np.float32), "uint8"),
        (np.zeros((8, 8, 2), np.uint8), "C in"),
        (np.zeros((2, 8, 8, 3), np.uint8), "C in"),
        (np.zeros((0, 8, 3), np.uint8), "empty"),
        ([[0, 0], [0, 0]], "encoded bytes or a uint8 array"),
    ],
)
def test_bad_images_are_refused(image: Any, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        preprocess_image(image)


def test_size_is_checked_before_decoding() -> None:
    small = VisionPreprocessConfig(max_decoded_pixels=20 * 20 - 1)
    with pytest.raises(ValueError, match="too large: 20x20"):
        preprocess_image(_encode(Image.fromarray(_noise((20, 20, 3), 0)), "PNG"), small)
    with pytest.raises(ValueError, match="too large"):
        preprocess_video(np.zeros((2, 20, 20, 3), np.uint8), 1.0, small)


@pytest.mark.parametrize(
    ("overrides", "field"),
    [
        ({"patch_size": 0}, "patch_size"), ({"min_pixels": 10**8}, "min_pixels"), ({"video_fps": 0}, "video_fps"),
        ({"image_std": (0.5, 0.0, 0.5)}, "image_std"), ({"image_mean": (0.5, 0.5)}, "image_mean"),
        ({"video_min_frames": 1, "video_max_frames": 1}, "video_max_frames"),
        ({"rescale_factor": -1.0}, "rescale_factor"), ({"video_fps": math.inf}, "video_fps"),
    ],
)
def test_config_errors_name_the_field(overrides: dict[str, Any], field: str) -> None:
    with pytest.raises(ValueError, match=f"VisionPreprocessConfig.{field}"):
        VisionPreprocessConfig(**overrides)


# --- video: transformers' own code, cut out of the installed module ---------------------------------------

_VIDEO_SOURCE = Path(hf_pil.__file__).with_name("video_processing_qwen2_vl.py")


@functools.cache
def _hf_video_class() -> ast.ClassDef:
    tree = ast.parse(_VIDEO_SOURCE.read_text())
    return next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "Qwen2VLVideoProcessor")


def _hf_video_attr(name: str) -> Any:
    body = _hf_video_class().body
    node = next(n for n in body if isinstance(n, ast.Assign) and getattr(n.targets[0], "id", None) == name)
    return ast.literal_eval(node.value)


@functools.cache
def _hf_video_method(name: str) -> Callable[..., Any]:
    fn = next(n for n in _hf_video_class().body if isinstance(n, ast.FunctionDef) and n.name == name)
    namespace: dict[str, Any] = {"math": math, "torch": torch, "VideoMetadata": object}
    exec(compile(ast.Module(body=[fn], type_ignores=[]), str(_VIDEO_SOURCE), "exec"), namespace)
    self_stub = types.SimpleNamespace(num_frames=None, fps=None)
    return lambda *args, **kwargs: namespace[name](self_stub, *args, **kwargs)


def _hf_indices(num_frames: int, fps: float, config: VisionPreprocessConfig) -> np.ndarray:
    metadata = types.SimpleNamespace(total_num_frames=num_frames, fps=fps)
    return _hf_video_method("sample_frames")(
        metadata, temporal_patch_size=config.temporal_patch_size, min_frames=config.video_min_frames,
        max_frames=config.video_max_frames, fps=config.video_fps,
    ).numpy()


@pytest.mark.parametrize("config", [CFG, VisionPreprocessConfig(video_fps=0.5, video_max_frames=16)])
def test_frame_sampling_equals_transformers_sample_frames(config: VisionPreprocessConfig) -> None:
    num_past_end = 0
    for num_frames in range(2, 400):
        for fps in (1.0, 7.5, 24.0, 25.0, 29.97, 30.0, 60.0):
            ours = sample_frame_indices(num_frames, fps, config)
            ref = _hf_indices(num_frames, fps, config)
            if len(ref) == len(ours) + 1:
                # NOTE: transformers' float arange length: an extra index == num_frames (an IndexError there).
                assert ref[-1] == num_frames
                ref, num_past_end = ref[:-1], num_past_end + 1
            np.testing.assert_array_equal(ours, ref, err_msg=f"{num_frames} frames at {fps} fps")
    assert num_past_end > 0  # the transformers quirk is real, and excluded on purpose
    # Fewer frames than a temporal patch: transformers divides by zero; ours keeps them (padded later).
    with pytest.raises(ZeroDivisionError):
        _hf_indices(1, 30.0, config)
    np.testing.assert_array_equal(sample_frame_indices(1, 30.0, config), [0])


def _hf_video(frames: np.ndarray, fps: float) -> tuple[np.ndarray, tuple[int, ...]]:
    """transformers' video pipeline for one video (see the module docstring for what is re-derived)."""
    indices = _hf_indices(len(frames), fps, CFG) if len(frames) >= CFG.temporal_patch_size else np.arange(len(frames))
    video = torch.from_numpy(frames[indices]).permute(0, 3, 1, 2).contiguous()
    video = video.repeat(1, 3, 1, 1) if video.shape[1] == 1 else video
    height, width = hf_pil.smart_resize(*video.shape[-2:], 32, CFG.video_min_pixels, CFG.video_max_pixels)
    if (height, width) != tuple(video.shape[-2:]):
        video = torch.nn.functional.interpolate(video, [height, width], mode="bicubic", antialias=True)
    mean = torch.tensor([0.5, 0.5, 0.5]) * (1.0 / (1 / 255))
    std = torch.tensor([0.5, 0.5, 0.5]) * (1.0 / (1 / 255))
    video = (video.to(torch.float32) - mean.view(-1, 1, 1)) / std.view(-1, 1, 1)
    patches, grid_t, grid_h, grid_w = _hf_video_method("patchify")(video[None], 16, 2, 2)
    return patches[0].numpy(), (grid_t, grid_h, grid_w)


@pytest.mark.parametrize(
    ("shape", "fps", "grid_t"),
    [
        ((30, 67, 141, 3), 30.0, 2),  # 1 s: 2 frames raised to min_frames 4
        ((95, 120, 160, 3), 25.0, 3),  # 7.6 frames at 2 fps, floored to 6
        ((1, 48, 64, 3), 30.0, 1),  # one frame, padded by repetition
        ((9, 720, 1280, 3), 2.0, 4),  # above the per-frame maximum: downscaled
        ((6, 20, 30, 1), 1.0, 3),  # tiny greyscale frames: upscaled
    ],
)
def test_video_equals_rederived_video_processor(shape: tuple[int, ...], fps: float, grid_t: int) -> None:
    frames = _noise(shape, seed=shape[0])
    ours = preprocess_video(frames, fps)
    ref_values, ref_grid = _hf_video(frames, fps)
    assert ours.grid_thw == ref_grid and ours.grid_thw[0] == grid_t
    np.testing.assert_array_equal(ours.pixel_values, ref_values)
    if shape[0] == 1:  # the repeated frame fills both halves of every row
        half = ours.pixel_values.reshape(-1, 3, 2, 16 * 16)
        np.testing.assert_array_equal(half[:, :, 0], half[:, :, 1])


def test_video_frames_match_the_image_path_within_two_levels() -> None:
    frames = _noise((4, 90, 170, 3), seed=11)
    config = VisionPreprocessConfig(min_pixels=CFG.video_min_pixels, max_pixels=CFG.video_max_pixels)
    height, width = smart_resize(90, 170, 32, CFG.video_min_pixels, CFG.video_max_pixels)
    video = resize_and_normalize_frames(frames, height, width, config)
    for frame, ours in zip(frames, video, strict=True):
        image = resize_and_normalize(frame, height, width, config)
        diff = np.abs(image - ours)
        assert diff.max() <= 2 / 127.5 + 1e-6 and diff.mean() < 1e-3  # PIL vs torch bicubic rounding


def test_seconds_per_temporal_patch_feed_mrope_like_transformers() -> None:
    ours = preprocess_video(_noise((100, 32, 32, 3), 12), 25.0)  # 4 s at 2 fps: 8 frames, no clamping
    assert ours.sample_fps == CFG.video_fps and ours.grid_thw[0] == 4
    assert ours.second_per_grid == CFG.temporal_patch_size / CFG.video_fps  # the processor's value for fps=2
    np.testing.assert_array_equal(ours.timestamps, [0.0, 1.0, 2.0, 3.0])
    # get_rope_index: torch.arange(grid_t) * second_per_grids[i] * position_id_per_seconds (13)
    ref_t = torch.arange(ours.grid_thw[0]) * torch.tensor([ours.second_per_grid]).float() * 13
    np.testing.assert_allclose(ours.timestamps * 13, ref_t.numpy())
    clamped = preprocess_video(_noise((30, 32, 32, 3), 13), 30.0)  # 1 s raised to 4 frames: 4 fps
    assert clamped.sample_fps == 4.0 and clamped.second_per_grid == 0.5


@pytest.mark.parametrize(
    ("frames", "fps", "message"),
    [
        (np.zeros((4, 8, 8, 3), np.float32), 2.0, "uint8"),
        (np.zeros((8, 8, 3), np.uint8), 2.0, "TxHxWxC"),
        (np.zeros((4, 8, 8, 4), np.uint8), 2.0, "TxHxWxC"),
        (np.zeros((0, 8, 8, 3), np.uint8), 2.0, "empty"),
        (np.zeros((4, 8, 8, 3), np.uint8), 0.0, "fps"),
        (np.zeros((4, 8, 8, 3), np.uint8), math.nan, "fps"),
        (np.zeros((4, 1, 300, 3), np.uint8), 2.0, "aspect ratio"),
    ],
)
def test_bad_videos_are_refused(frames: np.ndarray, fps: float, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        preprocess_video(frames, fps)
