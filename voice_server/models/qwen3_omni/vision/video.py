"""Video preprocessing of the Qwen3-Omni vision tower: frame sampling, resize, normalise, temporal patches.

The algorithm of transformers' `Qwen2VLVideoProcessor` (the video processor `qwen3_omni_moe` maps to,
which needs torchvision, so it is re-derived here), with the sizes `Qwen3OmniMoeProcessor` passes:
- sampling (`sample_frames` with `fps`): n = total / fps * video_fps, clamped to [video_min_frames,
  min(video_max_frames, total) floored to temporal_patch_size], floored to temporal_patch_size;
  frames floor(i * total / n).
- every frame is resized to the same `smart_resize` grid (video pixel limits) with torch's uint8
  antialiased bicubic (what torchvision runs on CPU uint8), then (x - 255 * mean) / (255 * std) in
  float32 (the processor's fused rescale + normalise). NOTE: images go through PIL instead (the image
  processor's PIL backend), which can differ from this resize by a level or two at a few pixels.
- a frame count that is not a multiple of temporal_patch_size is padded by repeating the last frame.

`second_per_grid` is the seconds one temporal patch spans, the quantity the thinker's M-RoPE reads
(transformers' `video_second_per_grid`, which `get_rope_index` multiplies by `position_id_per_seconds`
and the temporal patch index): temporal_patch_size / the fps the frames were sampled at.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from voice_server.models.qwen3_omni.vision.preprocess import VisionPreprocessConfig, patchify, smart_resize


@dataclass(frozen=True)
class VideoPatches:
    pixel_values: np.ndarray  # [num_patches, patch_dim] float32, in the processor's patch order
    grid_thw: tuple[int, int, int]  # (temporal patches, patch rows, patch columns)
    frame_indices: np.ndarray  # [num_sampled] int64: the input frames used, before temporal padding
    sample_fps: float  # sampled frames per second of video: num_sampled / duration
    second_per_grid: float  # seconds per temporal patch: temporal_patch_size / sample_fps

    @property
    def timestamps(self) -> np.ndarray:
        """[grid_t] float64: start time in seconds of each temporal patch (the M-RoPE time axis is this
        times `position_id_per_seconds`)."""
        return np.arange(self.grid_thw[0], dtype=np.float64) * self.second_per_grid

    def num_tokens(self, merge_size: int) -> int:
        """LLM placeholder tokens: one per merge x merge block."""
        t, h, w = self.grid_thw
        return t * h * w // merge_size**2


def sample_frame_indices(num_frames: int, fps: float, config: VisionPreprocessConfig) -> np.ndarray:
    """Indices of the frames kept from a `num_frames`-long clip at `fps`, sampled at `config.video_fps`."""
    if num_frames <= 0:
        raise ValueError(f"video has no frames (num_frames={num_frames})")
    if not (math.isfinite(fps) and fps > 0):
        raise ValueError(f"video fps must be a finite number > 0, got {fps!r}")
    t = config.temporal_patch_size
    max_frames = math.floor(min(config.video_max_frames, num_frames) / t) * t
    target = min(max(num_frames / fps * config.video_fps, config.video_min_frames), max_frames, num_frames)
    num_sampled = math.floor(target / t) * t
    if num_sampled == 0:
        # NOTE: fewer frames than one temporal patch: transformers divides by zero here. Keep them all;
        # patchify pads by repeating the last, as it does for unsampled videos.
        return np.arange(num_frames, dtype=np.int64)
    # NOTE: exact integers. transformers' torch.arange(0, total, total / n) gives these same values, but
    # its float length sometimes adds an (n+1)-th index equal to `total`, past the end of the clip.
    return np.arange(num_sampled, dtype=np.int64) * num_frames // num_sampled


def _check_frames(frames: np.ndarray, config: VisionPreprocessConfig) -> None:
    if not isinstance(frames, np.ndarray):
        raise ValueError(f"video frames must be a uint8 array, got {type(frames).__name__}")
    if frames.dtype != np.uint8:
        raise ValueError(f"video frames must be uint8, got {frames.dtype}")
    if frames.ndim != 4 or frames.shape[3] not in (1, 3):
        raise ValueError(f"video frames must be TxHxWxC with C in (1, 3), got shape {frames.shape}")
    num_frames, height, width = frames.shape[:3]
    if num_frames == 0 or height == 0 or width == 0:
        raise ValueError(f"video is empty, shape {frames.shape}")
    if height * width > config.max_decoded_pixels:
        raise ValueError(
            f"video frames are too large: {height}x{width} = {height * width} pixels, above the limit of "
            f"{config.max_decoded_pixels}"
        )


def resize_and_normalize_frames(
    frames: np.ndarray, height: int, width: int, config: VisionPreprocessConfig
) -> np.ndarray:
    """[T, H, W, 3] uint8 -> [T, 3, height, width] float32, resized and normalised as the video processor does."""
    video = torch.from_numpy(np.ascontiguousarray(frames)).permute(0, 3, 1, 2).contiguous()
    if (height, width) != tuple(video.shape[-2:]):
        # NOTE: uint8 in, uint8 out (the rounding and clamping happen inside the kernel), as torchvision's
        # resize does for bicubic on CPU.
        video = F.interpolate(video, size=[height, width], mode="bicubic", align_corners=False, antialias=True)
    # NOTE: the processor folds the 1/255 rescale into mean and std (float32) and normalises in float32.
    mean = torch.tensor(config.image_mean) * (1.0 / config.rescale_factor)
    std = torch.tensor(config.image_std) * (1.0 / config.rescale_factor)
    return ((video.to(torch.float32) - mean.view(-1, 1, 1)) / std.view(-1, 1, 1)).numpy()


def preprocess_video(frames: np.ndarray, fps: float, config: VisionPreprocessConfig | None = None) -> VideoPatches:
    """Decoded frames [T, H, W, C] uint8 (C = 3 RGB, or 1 greyscale) at `fps` frames per second -> the
    vision tower's pixel_values and grid_thw, the frames used and the seconds per temporal patch."""
    config = config or VisionPreprocessConfig()
    _check_frames(frames, config)
    num_frames, in_height, in_width = frames.shape[:3]
    indices = sample_frame_indices(num_frames, fps, config)
    sampled = frames[indices]
    if sampled.shape[3] == 1:
        sampled = np.repeat(sampled, 3, axis=3)
    height, width = smart_resize(in_height, in_width, config.factor, config.video_min_pixels, config.video_max_pixels)
    video = resize_and_normalize_frames(sampled, height, width, config)
    if pad := -len(video) % config.temporal_patch_size:
        video = np.concatenate([video, np.repeat(video[-1:], pad, axis=0)])
    pixel_values, grid_thw = patchify(video, config)
    sample_fps = len(indices) * fps / num_frames
    return VideoPatches(
        pixel_values=pixel_values,
        grid_thw=grid_thw,
        frame_indices=indices,
        sample_fps=sample_fps,
        second_per_grid=config.temporal_patch_size / sample_fps,
    )
