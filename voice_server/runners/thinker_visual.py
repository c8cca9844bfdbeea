"""The thinker's image and video prompts: what the encoder stage sends for them, checked once, and what
each step feeds their rows.

A NEW payload from the encoder stage (its RESULT; the contract is `voice_server/runners/encoder_runner.py`)
may carry, besides `token_ids` with its vision blocks expanded: `visual_embeds` [M, H] (the rows of the
prompt's M image and video placeholders, in prompt order), `visual_deepstack` [k, M, H] (their DeepStack
features, k = the tower's `deepstack_visual_indexes`), `image_grid_thw` / `video_grid_thw` [[t, h, w], ...]
and `video_second_per_grid` [seconds per temporal patch of each video]. `admit_vision` checks them (an
`AdmissionError` names the field) and computes the prompt's M-RoPE positions once
(`voice_server/models/qwen3_omni/thinker/rope.py`: each block's rows sit on its t / h / w grid, the text
after a block resumes past the block's largest position), giving a `PromptVision`.

In a step (`step_positions`, `step_deepstack`): every row takes its M-RoPE positions (`prompt_positions.py`: a
prompt row its stored ones, a later row, streamed prompt text or a generated token, `p + delta` on all three axes
or, after a video whose frame times are fractional, the row before + 1), and the prompt's image
and video rows take their DeepStack features, each chunk its own share at its rows of the step, so a
chunked prefill may cut a block anywhere. Every row is rebuilt from this stored state, so a preempted
request recomputes exactly.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from voice_server.models.qwen3_omni.thinker.config import ThinkerConfig
from voice_server.models.qwen3_omni.thinker.rope import RopeLayout, get_rope_index
from voice_server.models.qwen3_omni.thinker.visual import Deepstack, VisualInputs
from voice_server.runners.payload import float_array, float_rows, int_rows, positive_floats
from voice_server.runners.prompt_positions import PromptPositions
from voice_server.scheduling import AdmissionError

GRID_KEYS = ("image_grid_thw", "video_grid_thw", "video_second_per_grid")
VISUAL_KEYS = ("visual_embeds", "visual_deepstack", *GRID_KEYS)


@dataclass(frozen=True)
class PromptVision:
    """One prompt's images and videos as the steps read them (tensors on the runner's device)."""

    rows: list[int]
    """Prompt positions of the image and video placeholders, in order: the rows of `embeds`."""
    embeds: torch.Tensor  # [M, H]
    deepstack: Deepstack  # rows: prompt positions
    positions: PromptPositions
    """Its rows' M-RoPE positions (the prompt's, and every row after it)."""
    grids: VisualInputs
    """The grids alone (no features): what the talker needs for its prefill positions."""

    def rope_rows(self, start: int, end: int) -> torch.Tensor:
        """[3, end - start] positions of rows [start, end)."""
        return self.positions.rows(start, end)

    def deepstack_rows(self, start: int, end: int, row_offset: int) -> Deepstack | None:
        """The DeepStack features of rows [start, end), at `row_offset` on; None when none are there."""
        if start > self.rows[-1] or end <= self.rows[0]:
            return None  # NOTE: checked on the host: a decode step never slices the features
        return self.deepstack.slice_rows(start, end, row_offset)


@dataclass(frozen=True)
class StepSpan:
    """One sequence of a step: its first row in the step's flat rows, its positions [start, end)."""

    row: int
    start: int
    end: int
    vision: PromptVision | None


def admit_vision(
    fields: dict[str, Any], token_ids: list[int], cfg: ThinkerConfig, device: torch.device, dtype: torch.dtype,
) -> PromptVision | None:
    """A prompt's vision fields (`VISUAL_KEYS` of its NEW payload), checked against its placeholders; None
    when it has no image or video."""
    is_visual = {cfg.image_token_id, cfg.video_token_id}
    rows = [i for i, t in enumerate(token_ids) if t in is_visual]
    if not fields:
        if rows:
            raise AdmissionError(f"payload.visual_embeds: the prompt has {len(rows)} image / video placeholders "
                                 "but no visual_embeds (images and videos go through the encoder stage)")
        return None
    hidden = cfg.text.hidden_size
    embeds = float_rows("payload.visual_embeds", fields.get("visual_embeds"), hidden, len(rows))
    num_deepstack = len(cfg.vision.deepstack_visual_indexes)
    deepstack = float_array("payload.visual_deepstack", fields.get("visual_deepstack"),
                            (num_deepstack, len(rows), hidden))
    grids = read_grids("payload", fields)
    merge = cfg.vision.spatial_merge_size
    _check_grids("payload.image_grid_thw", grids.image_grid_thw, merge, token_ids.count(cfg.image_token_id), "image")
    _check_grids("payload.video_grid_thw", grids.video_grid_thw, merge, token_ids.count(cfg.video_token_id), "video")
    if not rows:
        return None
    try:
        positions, _ = get_rope_index(torch.tensor([token_ids]), RopeLayout.of_thinker(cfg), **grids.rope_grids())
    except ValueError as exc:
        raise AdmissionError(f"payload.token_ids: {exc}") from exc
    return PromptVision(
        rows, embeds.to(device, dtype),
        Deepstack(torch.tensor(rows, device=device), deepstack.to(device, dtype)),
        PromptPositions(positions[:, 0].to(device)), grids,
    )


def read_grids(where: str, fields: Mapping[str, Any]) -> VisualInputs:
    """The `GRID_KEYS` of a payload (absent: none) checked for form, as `VisualInputs` without features."""
    images = int_rows(f"{where}.image_grid_thw", fields.get("image_grid_thw", []), 3)
    videos = int_rows(f"{where}.video_grid_thw", fields.get("video_grid_thw", []), 3)
    seconds = positive_floats(f"{where}.video_second_per_grid", fields.get("video_second_per_grid", []), len(videos))
    return VisualInputs(
        image_grid_thw=torch.tensor(images) if images else None,
        video_grid_thw=torch.tensor(videos) if videos else None,
        video_second_per_grid=torch.tensor(seconds, dtype=torch.float32) if videos else None,
    )


def _check_grids(where: str, grids: torch.Tensor | None, merge: int, num_tokens: int, kind: str) -> None:
    """Each grid's h and w merge evenly, and the grids' tokens are the prompt's placeholders of their kind."""
    rows = [] if grids is None else grids.tolist()
    for i, (_, h, w) in enumerate(rows):
        if h % merge or w % merge:
            raise AdmissionError(f"{where}[{i}]: h and w must be multiples of the spatial merge size {merge}, "
                                 f"got {rows[i]}")
    num_grid_tokens = sum(t * h * w // merge**2 for t, h, w in rows)
    if num_grid_tokens != num_tokens:
        raise AdmissionError(f"{where}: {len(rows)} grids of {num_grid_tokens} tokens for the prompt's "
                             f"{num_tokens} {kind} placeholders")


def step_positions(flat: torch.Tensor, spans: Sequence[StepSpan]) -> torch.Tensor:
    """[3, T] positions of a step holding a vision prompt, from its flat positions [T] (padding rows: 0):
    float32 on every row when any vision prompt's are (whole positions stay exact in float32)."""
    is_float = any(s.vision is not None and s.vision.positions.is_fractional for s in spans)
    positions = flat.expand(3, -1).contiguous().to(torch.float32 if is_float else flat.dtype)
    for s in spans:
        if s.vision is not None:
            positions[:, s.row:s.row + s.end - s.start] = s.vision.rope_rows(s.start, s.end)
    return positions


def step_deepstack(spans: Sequence[StepSpan]) -> Deepstack | None:
    """The DeepStack features of a step's image and video rows (None: it has none)."""
    parts = [s.vision.deepstack_rows(s.start, s.end, s.row) for s in spans if s.vision is not None]
    return Deepstack.concat([p for p in parts if p is not None])
