"""Image and video inputs of the thinker: the vision tower's features and where DeepStack adds them.

The thinker does not hold the vision tower (the encoder stage runs it). It receives, per prompt, the
embeddings of its images and of its videos (which replace the image / video placeholder embeddings in
prompt order, as audio features do) and their DeepStack features: feature i is added to the hidden
states at every image / video placeholder row after decoder layer i (transformers' `_deepstack_process`).
When a prompt has both, the reference lays its features out by row order over the joint image | video
mask; `visual_deepstack` does the same.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

# A vision tower call: (pixel_values [num_patches, patch_dim], grid_thw [num_items, 3]) -> (embeds [N, H],
# DeepStack features, k x [N, H]); `vision.encoder.VisionEncoder` is one.
VisionTower = Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, Sequence[torch.Tensor]]]


@dataclass(frozen=True)
class VisualInputs:
    """One prompt's (or one batch's, rows one after another) images and videos, each kind in prompt order."""

    image_embeds: torch.Tensor | None = None  # [num_image_tokens, H]: every image's merged patches
    image_deepstack: tuple[torch.Tensor, ...] = ()  # k x [num_image_tokens, H], DeepStack layer order
    image_grid_thw: torch.Tensor | None = None  # [num_images, 3] (t, h, w) in patches
    video_embeds: torch.Tensor | None = None  # [num_video_tokens, H]
    video_deepstack: tuple[torch.Tensor, ...] = ()  # k x [num_video_tokens, H]
    video_grid_thw: torch.Tensor | None = None  # [num_videos, 3]
    video_second_per_grid: torch.Tensor | None = None  # [num_videos] float: seconds per temporal patch

    @classmethod
    def encode(
        cls,
        tower: VisionTower,
        pixel_values: torch.Tensor | None = None,
        image_grid_thw: torch.Tensor | None = None,
        pixel_values_videos: torch.Tensor | None = None,
        video_grid_thw: torch.Tensor | None = None,
        video_second_per_grid: torch.Tensor | None = None,
    ) -> VisualInputs:
        """Run `tower` on the images' and the videos' patches (one call per kind, as the reference does)."""
        image: tuple[torch.Tensor | None, Sequence[torch.Tensor]] = (None, ())
        video: tuple[torch.Tensor | None, Sequence[torch.Tensor]] = (None, ())
        if pixel_values is not None:
            if image_grid_thw is None:
                raise ValueError("pixel_values needs image_grid_thw")
            image = tower(pixel_values, image_grid_thw)
        if pixel_values_videos is not None:
            if video_grid_thw is None:
                raise ValueError("pixel_values_videos needs video_grid_thw")
            video = tower(pixel_values_videos, video_grid_thw)
        return cls(
            image_embeds=image[0], image_deepstack=tuple(image[1]), image_grid_thw=image_grid_thw,
            video_embeds=video[0], video_deepstack=tuple(video[1]), video_grid_thw=video_grid_thw,
            video_second_per_grid=video_second_per_grid,
        )

    def rope_grids(self) -> dict[str, torch.Tensor | None]:
        """The grid arguments of `rope.get_rope_index` (`**visual.rope_grids()`)."""
        return {
            "image_grid_thw": self.image_grid_thw, "video_grid_thw": self.video_grid_thw,
            "video_second_per_grid": self.video_second_per_grid,
        }


@dataclass(frozen=True)
class Deepstack:
    """DeepStack features of some rows of a flat batch: `embeds[i]` is added at `rows` after decoder layer i."""

    rows: torch.Tensor  # [R] int64, distinct: indices into the flat rows (B * L dense, T paged)
    embeds: torch.Tensor  # [k, R, H]

    def __post_init__(self) -> None:
        if self.rows.ndim != 1 or self.embeds.ndim != 3 or self.embeds.shape[1] != self.rows.shape[0]:
            raise ValueError(
                f"Deepstack rows must be [R] and embeds [k, R, H], got {tuple(self.rows.shape)} and "
                f"{tuple(self.embeds.shape)}"
            )

    @property
    def num_layers(self) -> int:
        return self.embeds.shape[0]

    def add_to(self, hidden: torch.Tensor, layer_idx: int) -> torch.Tensor:
        """hidden [..., H] (rows flattened in order) plus feature `layer_idx` at `rows`; the same one add
        per element as the reference's masked update, so the sums are bit-equal."""
        flat = hidden.reshape(-1, hidden.shape[-1])
        flat = flat.index_add(0, self.rows, self.embeds[layer_idx].to(flat.dtype))
        return flat.view(hidden.shape)

    def slice_rows(self, start: int, end: int, row_offset: int = 0) -> Deepstack:
        """The rows in [start, end), moved to start at `row_offset`: a prefill chunk's share of a prompt's
        features, placed where the chunk sits in a step's flat batch."""
        keep = (self.rows >= start) & (self.rows < end)
        return Deepstack(self.rows[keep] - start + row_offset, self.embeds[:, keep])

    @staticmethod
    def concat(parts: Sequence[Deepstack]) -> Deepstack | None:
        """One step's features from its chunks' (rows already in the step's flat numbering)."""
        parts = [p for p in parts if p.rows.numel()]
        if not parts:
            return None
        if len({p.num_layers for p in parts}) != 1:
            raise ValueError(f"Deepstack parts have different layer counts: {[p.num_layers for p in parts]}")
        return Deepstack(torch.cat([p.rows for p in parts]), torch.cat([p.embeds for p in parts], dim=1))


def _stacked(kind: str, features: tuple[torch.Tensor, ...], num_rows: int) -> torch.Tensor | None:
    if not features:
        return None
    stacked = torch.stack(features)  # [k, N, H]
    if stacked.shape[1] != num_rows:
        raise ValueError(f"{num_rows} {kind} placeholder tokens but {stacked.shape[1]} {kind} DeepStack rows")
    return stacked


def visual_deepstack(
    input_ids: torch.Tensor, image_token_id: int, video_token_id: int, visual: VisualInputs
) -> Deepstack | None:
    """The DeepStack features of a prompt (input_ids [L]) or batch ([B, L], rows flattened), or None
    when `visual` has none. Image rows take the image features in order, video rows the video ones."""
    is_image = (input_ids == image_token_id).flatten()
    is_video = (input_ids == video_token_id).flatten()
    image = _stacked("image", visual.image_deepstack, int(is_image.sum()))
    video = _stacked("video", visual.video_deepstack, int(is_video.sum()))
    present = [f for f in (image, video) if f is not None]
    if not present:
        return None
    for kind, features, is_kind in (("image", image, is_image), ("video", video, is_video)):
        if features is None and bool(is_kind.any()):
            raise ValueError(f"the prompt has {kind} placeholders but no {kind} DeepStack features")
    if len({f.shape[0] for f in present}) != 1:
        raise ValueError("image and video DeepStack features have different layer counts")
    is_visual = is_image | is_video
    rows = torch.nonzero(is_visual).flatten()
    embeds = present[0].new_zeros(present[0].shape[0], rows.shape[0], present[0].shape[2])
    # NOTE: the reference's joint layout: visual rows in row order, each kind's features in its own order.
    if image is not None:
        embeds[:, is_image[is_visual]] = image
    if video is not None:
        embeds[:, is_video[is_visual]] = video
    return Deepstack(rows, embeds)
