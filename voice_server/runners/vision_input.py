"""Images and videos in an encoder stage's requests: checking them at `admit` and running them in `execute`.

Admission (`admit_vision`) preprocesses every item as the model's processors do
(`voice_server/models/qwen3_omni/vision/preprocess.py`, `video.py`), refuses an item whose single frame
needs more activation memory than the stage's budget (`vision_plan.py`), and expands each vision block
of `token_ids` to its item's tokens. Execution (`encode_vision`) runs a batch's items in the forwards
`plan_forwards` packs them into and hands each request its rows back. The payload contract is the
runner's: `voice_server/runners/encoder_runner.py`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from voice_server.models.qwen3_omni.thinker.config import ThinkerConfig
from voice_server.models.qwen3_omni.vision.config import VisionEncoderConfig
from voice_server.models.qwen3_omni.vision.encoder import VisionEncoder
from voice_server.models.qwen3_omni.vision.preprocess import VisionPreprocessConfig, preprocess_image
from voice_server.models.qwen3_omni.vision.video import preprocess_video
from voice_server.runners.prompt_blocks import BlockKind, checked_token_ids, expand_blocks, find_blocks
from voice_server.runners.vision_plan import Grid, peak_activation_bytes, plan_forwards
from voice_server.scheduling import AdmissionError

VISION_KEYS = ("images", "videos")
RESULT_KEYS = ("visual_embeds", "visual_deepstack", "image_grid_thw", "video_grid_thw", "video_second_per_grid")
_GIB = 2**30


@dataclass(frozen=True)
class VisionInputConfig:
    image_token_id: int
    video_token_id: int
    vision_start_token_id: int
    vision_end_token_id: int
    vocab_size: int
    tower: VisionEncoderConfig
    dtype_bytes: int
    """Bytes per element of the tower's weights and activations (2: bf16, 4: fp32)."""
    activation_budget_bytes: int
    """The most one tower forward may hold in activations (`vision_plan.peak_activation_bytes`)."""

    def __post_init__(self) -> None:
        ids = (self.image_token_id, self.video_token_id, self.vision_start_token_id, self.vision_end_token_id)
        if len(set(ids)) != 4 or not all(0 <= i < self.vocab_size for i in ids):
            raise ValueError(f"VisionInputConfig: vision ids {ids} must be distinct, < {self.vocab_size}")
        if self.dtype_bytes not in (2, 4):
            raise ValueError(f"VisionInputConfig.dtype_bytes must be 2 or 4, got {self.dtype_bytes!r}")
        if isinstance(self.activation_budget_bytes, bool) or not isinstance(self.activation_budget_bytes, int) \
                or self.activation_budget_bytes < 1:
            raise ValueError(f"VisionInputConfig.activation_budget_bytes must be an integer >= 1, got "
                             f"{self.activation_budget_bytes!r}")
        if self.tower.in_channels != 3:
            raise ValueError(f"VisionInputConfig.tower.in_channels must be 3 (RGB), got {self.tower.in_channels}")

    @classmethod
    def from_thinker(cls, cfg: ThinkerConfig, dtype_bytes: int, activation_budget_bytes: int) -> VisionInputConfig:
        return cls(cfg.image_token_id, cfg.video_token_id, cfg.vision_start_token_id, cfg.vision_end_token_id,
                   cfg.text.vocab_size, cfg.vision, dtype_bytes, activation_budget_bytes)

    @property
    def preprocess(self) -> VisionPreprocessConfig:
        """The processors' settings at this tower's patch sizes (the rest are the released ones)."""
        t = self.tower
        return VisionPreprocessConfig(patch_size=t.patch_size, temporal_patch_size=t.temporal_patch_size,
                                      merge_size=t.spatial_merge_size)

    def block_kinds(self) -> tuple[BlockKind, BlockKind]:
        start, end = self.vision_start_token_id, self.vision_end_token_id
        return (BlockKind("image", "image", "vision", start, self.image_token_id, end),
                BlockKind("video", "video", "vision", start, self.video_token_id, end))


@dataclass(frozen=True)
class AdmittedVision:
    """What `admit_vision` leaves in `payload["vision"]`: a request's images and videos, in prompt order."""

    pixel_values: tuple[np.ndarray, ...]
    """[t * h * w, patch_dim] float32 each, in the processor's patch order (frame after frame)."""
    grids: tuple[Grid, ...]
    is_video: tuple[bool, ...]
    video_second_per_grid: tuple[float, ...]
    """Seconds per temporal patch of each video, in video order (the thinker's M-RoPE time axis)."""

    def __post_init__(self) -> None:
        if not len(self.pixel_values) == len(self.grids) == len(self.is_video) > 0 \
                or len(self.video_second_per_grid) != sum(self.is_video):
            raise ValueError("AdmittedVision: pixel_values, grids, is_video and video_second_per_grid differ in length")

    def result_fields(self, embeds: torch.Tensor, deepstack: torch.Tensor) -> dict[str, Any]:
        """The RESULT payload's vision keys (RESULT_KEYS), given this request's rows from `encode_vision`."""
        grids = [list(g) for g in self.grids]
        return {
            "visual_embeds": embeds,
            "visual_deepstack": deepstack,
            "image_grid_thw": [g for g, is_video in zip(grids, self.is_video) if not is_video],
            "video_grid_thw": [g for g, is_video in zip(grids, self.is_video) if is_video],
            "video_second_per_grid": list(self.video_second_per_grid),
        }


def admit_vision(payload: dict[str, Any], config: VisionInputConfig | None) -> dict[str, Any]:
    """`payload` with `images`/`videos` checked, preprocessed and replaced by `vision` (an AdmittedVision),
    and its vision blocks expanded; the same object when it has neither (empty lists are dropped)."""
    given = {key: payload[key] for key in VISION_KEYS if payload.get(key) is not None}
    for key, value in given.items():
        if not isinstance(value, list | tuple):
            raise AdmissionError(f"payload.{key}: must be a list, got {type(value).__name__}")
    if not any(given.values()):
        token_ids = payload.get("token_ids")
        blocks = find_blocks(token_ids, config.block_kinds()) if config and isinstance(token_ids, list) else []
        if blocks:
            key = f"{blocks[0].kind.name}s"
            raise AdmissionError(f"payload.{key}: the prompt has {key[:-1]} blocks but no {key} were given")
        return {k: v for k, v in payload.items() if k not in given} if given else payload
    if config is None:
        key = next(k for k, v in given.items() if v)
        raise AdmissionError(f"payload.{key}: this pipeline does not take {key} (its encoder stage has no "
                             "vision tower: factory_args.vision)")
    token_ids = checked_token_ids(payload.get("token_ids"), config.vocab_size, "with images or videos")
    blocks = find_blocks(token_ids, config.block_kinds())
    for key in VISION_KEYS:
        num_items, num_blocks = len(given.get(key, ())), sum(b.kind.name == key[:-1] for b in blocks)
        if num_blocks != num_items:
            raise AdmissionError(f"payload.{key}: {num_items} {key}, but payload.token_ids has {num_blocks} "
                                 f"{key[:-1]} blocks")
    # NOTE: the cheap checks first: decoding and resizing are most of admission's work.
    images = [_image(f"payload.images[{i}]", value, config) for i, value in enumerate(given.get("images", ()))]
    videos = [_video(f"payload.videos[{i}]", value, config) for i, value in enumerate(given.get("videos", ()))]
    queues = {"image": iter(images), "video": iter(videos)}
    ordered = [next(queues[b.kind.name]) for b in blocks]
    merge = config.tower.spatial_merge_size
    counts = [t * h * w // merge**2 for _, (t, h, w), _ in ordered]
    vision = AdmittedVision(tuple(p for p, _, _ in ordered), tuple(g for _, g, _ in ordered),
                            tuple(s is not None for _, _, s in ordered),
                            tuple(s for _, _, s in ordered if s is not None))
    rest = {k: v for k, v in payload.items() if k not in given}
    return {**rest, "token_ids": expand_blocks(token_ids, blocks, counts), "vision": vision}


_Item = tuple[np.ndarray, Grid, float | None]
"""pixel_values, grid, seconds per temporal patch (None: an image)."""


def _image(where: str, value: Any, config: VisionInputConfig) -> _Item:
    try:
        patches = preprocess_image(value, config.preprocess)
    except ValueError as exc:
        raise AdmissionError(f"{where}: {exc}") from exc
    _check_budget(where, patches.grid_thw, config)
    return patches.pixel_values, patches.grid_thw, None


def _video(where: str, value: Any, config: VisionInputConfig) -> _Item:
    if not isinstance(value, dict) or set(value) != {"frames", "fps"}:
        shown = sorted(value) if isinstance(value, dict) else type(value).__name__
        raise AdmissionError(f"{where}: a video is {{'frames': THWC uint8 array, 'fps': number}}, got {shown}")
    fps = value["fps"]
    if isinstance(fps, bool) or not isinstance(fps, int | float) or not (math.isfinite(fps) and fps > 0):
        raise AdmissionError(f"{where}.fps: must be a number > 0, got {fps!r}")
    try:
        patches = preprocess_video(value["frames"], float(fps), config.preprocess)
    except ValueError as exc:
        raise AdmissionError(f"{where}.frames: {exc}") from exc
    _check_budget(where, patches.grid_thw, config)
    return patches.pixel_values, patches.grid_thw, patches.second_per_grid


def _check_budget(where: str, grid: Grid, config: VisionInputConfig) -> None:
    """Refuse an item whose one frame alone needs more than the budget (longer items are split by time)."""
    _, h, w = grid
    need = peak_activation_bytes(config.tower, config.dtype_bytes, h * w, h * w)
    if need > config.activation_budget_bytes:
        side = config.tower.patch_size
        raise AdmissionError(
            f"{where}: one frame of {h * side}x{w * side} pixels (after resizing; {h}x{w} patches) needs "
            f"{need / _GIB:.2f} GiB of activations; the stage's activation budget "
            f"(factory_args.activation_budget_mb) is {config.activation_budget_bytes / _GIB:.2f} GiB")


def encode_vision(
    tower: VisionEncoder, visions: Sequence[AdmittedVision], config: VisionInputConfig
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(embeds [N, out_hidden], DeepStack features [num_deepstack, N, out_hidden]) of each request, its
    items' rows in prompt order."""
    outputs = [run_forward(tower, inputs) for inputs in forward_inputs(visions, config)]
    # NOTE: the forwards' outputs concatenated are the items' rows, request after request.
    embeds, deepstack = torch.cat([e for e, _ in outputs]), torch.cat([d for _, d in outputs], dim=1)
    merge = config.tower.spatial_merge_size
    counts = [sum(t * h * w for t, h, w in vision.grids) // merge**2 for vision in visions]
    return list(zip(embeds.split(counts), deepstack.split(counts, dim=1), strict=True))


def forward_inputs(visions: Sequence[AdmittedVision], config: VisionInputConfig) -> list[list[tuple[np.ndarray, Grid]]]:
    """The (pixel rows, grid) pieces of each forward `plan_forwards` packs the batch into: requests in
    order, each one's items in prompt order, a video's frames in time order, split where the budget needs."""
    items = [(r, i) for r, vision in enumerate(visions) for i in range(len(vision.grids))]
    plan = plan_forwards([visions[r].grids[i] for r, i in items], config.tower, config.dtype_bytes,
                         config.activation_budget_bytes)
    if plan.refused:
        # NOTE: a bug: admission refuses every item whose frame does not fit (`_check_budget`, same formula).
        raise RuntimeError(f"admitted images/videos {list(plan.refused)} do not fit the activation budget")
    forwards = []
    for pieces in plan.forwards:
        inputs = []
        for piece in pieces:
            r, i = items[piece.item]
            _, h, w = visions[r].grids[i]
            rows = visions[r].pixel_values[i][piece.t_start * h * w:piece.t_end * h * w]
            inputs.append((rows, (piece.t_end - piece.t_start, h, w)))
        forwards.append(inputs)
    return forwards


def run_forward(tower: VisionEncoder, inputs: Sequence[tuple[np.ndarray, Grid]]) -> tuple[torch.Tensor, torch.Tensor]:
    """One tower forward over these (pixel rows, grid) pieces: (embeds, stacked DeepStack features), on the host."""
    device = next(tower.parameters()).device
    # NOTE: one new tensor of the forward's pixel rows (the input its budget counts).
    pixel_values = torch.cat([torch.from_numpy(rows) for rows, _ in inputs]).to(device)
    out = tower(pixel_values, torch.tensor([grid for _, grid in inputs]))
    del pixel_values
    # NOTE: off the device at once, so the outputs of earlier forwards never sit beside a later one's
    # activations (the budget bounds each forward); the relay reads them from host memory anyway.
    return out.embeds.cpu(), torch.stack(out.deepstack).cpu()
