"""Image / video prompts for the thinker parity tests: a tiny config with a vision tower that merges 2 x 2
patches and feeds two DeepStack layers into a 3-layer decoder, transformers' thinker built from it, and
prompts with their pixel inputs (random patches: the thinker tests compare the decoder, not images).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import transformers
from omni_reference import randomize_

from voice_server.models.qwen3_omni.audio.encoder import num_audio_tokens
from voice_server.models.qwen3_omni.presets import TINY_IDS, tiny_config_dict
from voice_server.models.qwen3_omni.thinker.config import ThinkerConfig
from voice_server.models.qwen3_omni.thinker.model import ThinkerModel
from voice_server.models.qwen3_omni.thinker.visual import VisualInputs
from voice_server.models.qwen3_omni.turn import TurnModels, load_turn_models

IDS = TINY_IDS
MERGE = 2
POSITION_ID_PER_SECONDS = 13


def vision_config_dict() -> dict[str, Any]:
    d = tiny_config_dict()
    d["thinker_config"]["vision_config"].update(spatial_merge_size=MERGE, depth=2, deepstack_visual_indexes=[0, 1])
    d["thinker_config"]["text_config"]["num_hidden_layers"] = 3  # DeepStack feeds layers 0 and 1, not 2
    d["talker_config"]["spatial_merge_size"] = MERGE
    return d


def thinker_pair(seed: int = 0) -> tuple[ThinkerModel, torch.nn.Module]:
    """(ours, transformers' thinker) with the same seeded weights; ours skips `model.visual.*`."""
    d = vision_config_dict()
    ref = transformers.Qwen3OmniMoeThinkerForConditionalGeneration(
        transformers.Qwen3OmniMoeConfig(**d).thinker_config
    ).eval()
    randomize_(ref, seed)
    ours = ThinkerModel(ThinkerConfig.from_hf_dict(d["thinker_config"])).eval()
    missing, unexpected = ours.load_state_dict(ref.state_dict(), strict=False)
    assert missing == [] and all(k.startswith(ThinkerModel.IGNORED_STATE_PREFIXES) for k in unexpected)
    return ours, ref


def hf_tower(ref: torch.nn.Module) -> Any:
    """transformers' own vision tower as a `VisionTower` (embeds, DeepStack features)."""

    def tower(pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
        out = ref.model.visual(pixel_values, grid_thw=grid_thw)
        return out.pooler_output, list(out.deepstack_features)

    return tower


def image_block(grid: Sequence[int]) -> list[int]:
    return [IDS["vision_start"]] + [IDS["image"]] * (grid[0] * grid[1] * grid[2] // MERGE**2) + [IDS["vision_end"]]


def video_block(grid: Sequence[int]) -> list[int]:
    return [IDS["vision_start"]] + [IDS["video"]] * (grid[0] * grid[1] * grid[2] // MERGE**2) + [IDS["vision_end"]]


def audio_block(num_frames: int) -> list[int]:
    return [IDS["audio_start"]] + [IDS["audio"]] * num_audio_tokens(num_frames) + [IDS["audio_end"]]


def audio_in_video_block(grid: Sequence[int], second_per_grid: float, num_frames: int) -> list[int]:
    """`<vision_start><audio_start>` video and audio placeholders interleaved by time, as transformers'
    processor lays them out (`replace_video_with_audio_token`), `<audio_end><vision_end>`."""
    num_per_frame = grid[1] * grid[2] // MERGE**2
    video_times = [t * second_per_grid * POSITION_ID_PER_SECONDS for t in range(grid[0]) for _ in range(num_per_frame)]
    num_audio = num_audio_tokens(num_frames)
    tokens, v, a = [], 0, 0
    while v < len(video_times) and a < num_audio:
        if video_times[v] <= a:
            tokens.append(IDS["video"])
            v += 1
        else:
            tokens.append(IDS["audio"])
            a += 1
    tokens += [IDS["video"]] * (len(video_times) - v) + [IDS["audio"]] * (num_audio - a)
    return [IDS["vision_start"], IDS["audio_start"], *tokens, IDS["audio_end"], IDS["vision_end"]]


def chat(*content: list[int]) -> list[int]:
    """`<|im_start|>user\\n` content `<|im_end|>\\n<|im_start|>assistant\\n`, text tokens around the blocks."""
    body = [tok for i, part in enumerate(content) for tok in [20 + i, *part]]
    return [IDS["im_start"], IDS["user"], 10, *body, 30, 31, IDS["im_end"], 10, IDS["im_start"], IDS["assistant"], 10]


def _patches(grids: list[tuple[int, int, int]], g: torch.Generator, patch_dim: int) -> torch.Tensor:
    return torch.randn(sum(t * h * w for t, h, w in grids), patch_dim, generator=g)


@dataclass(frozen=True)
class Prompt:
    """One prompt and its media: transformers' keyword arguments and what our thinker takes."""

    input_ids: torch.Tensor  # [1, L]
    image_grids: list[tuple[int, int, int]] = field(default_factory=list)
    video_grids: list[tuple[int, int, int]] = field(default_factory=list)
    second_per_grid: list[float] = field(default_factory=list)
    audio_frames: list[int] = field(default_factory=list)
    is_audio_in_video: bool = False
    seed: int = 0

    def media(self, patch_dim: int, num_mel_bins: int) -> dict[str, Any]:
        """transformers' inputs (pixel values, grids, features), the same random draws on every call."""
        g = torch.Generator().manual_seed(self.seed)
        kw: dict[str, Any] = {"attention_mask": torch.ones_like(self.input_ids)}
        if self.image_grids:
            kw["pixel_values"] = _patches(self.image_grids, g, patch_dim)
            kw["image_grid_thw"] = torch.tensor(self.image_grids)
        if self.video_grids:
            kw["pixel_values_videos"] = _patches(self.video_grids, g, patch_dim)
            kw["video_grid_thw"] = torch.tensor(self.video_grids)
            kw["video_second_per_grid"] = torch.tensor(self.second_per_grid)
        if self.audio_frames:
            longest = max(self.audio_frames)
            kw["input_features"] = torch.randn(len(self.audio_frames), num_mel_bins, longest, generator=g)
            frames = torch.tensor(self.audio_frames)
            kw["feature_attention_mask"] = (torch.arange(longest)[None] < frames[:, None]).long()
        if self.is_audio_in_video:
            kw["use_audio_in_video"] = True
        return kw


def visual_inputs(tower: Any, media: dict[str, Any]) -> VisualInputs:
    return VisualInputs.encode(
        tower, media.get("pixel_values"), media.get("image_grid_thw"), media.get("pixel_values_videos"),
        media.get("video_grid_thw"), media.get("video_second_per_grid"),
    )


def audio_inputs(ours: ThinkerModel, media: dict[str, Any]) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """(audio embeddings [N, H], feature lens) from transformers' padded features, or (None, None)."""
    if "input_features" not in media:
        return None, None
    mask = media["feature_attention_mask"]
    packed = media["input_features"].permute(0, 2, 1)[mask.bool()].permute(1, 0)
    lens = mask.sum(-1)
    return ours.encode_audio(packed, lens), lens


IMAGE_GRID, WIDE_GRID, VIDEO_GRID = (1, 4, 6), (1, 6, 2), (3, 4, 4)
PROMPTS: dict[str, Prompt] = {
    "image": Prompt(torch.tensor([chat(image_block(IMAGE_GRID))]), image_grids=[IMAGE_GRID]),
    "two_images": Prompt(
        torch.tensor([chat(image_block(IMAGE_GRID), image_block(WIDE_GRID))]), image_grids=[IMAGE_GRID, WIDE_GRID],
        seed=1,
    ),
    "video": Prompt(
        torch.tensor([chat(video_block(VIDEO_GRID))]), video_grids=[VIDEO_GRID], second_per_grid=[1.0], seed=2
    ),
    # 0.7 s per temporal patch x 13: frame times 9.1 apart, so every position after the video is fractional.
    "video_fractional_time": Prompt(
        torch.tensor([chat(video_block(VIDEO_GRID))]), video_grids=[VIDEO_GRID], second_per_grid=[0.7], seed=3
    ),
    "audio_video": Prompt(
        torch.tensor([chat(audio_block(230), video_block(VIDEO_GRID))]), video_grids=[VIDEO_GRID],
        second_per_grid=[2.0], audio_frames=[230], seed=4,
    ),
    "image_video": Prompt(
        torch.tensor([chat(video_block(VIDEO_GRID), image_block(IMAGE_GRID))]), image_grids=[IMAGE_GRID],
        video_grids=[VIDEO_GRID], second_per_grid=[1.0], seed=5,
    ),
    "audio_in_video": Prompt(
        torch.tensor([chat(audio_in_video_block(VIDEO_GRID, 0.5, 330))]), video_grids=[VIDEO_GRID],
        second_per_grid=[0.5], audio_frames=[330], is_audio_in_video=True, seed=6,
    ),
}


def save_vision_reference(ckpt: Path, seed: int = 0) -> tuple[torch.nn.Module, TurnModels]:
    """transformers' whole model at the tiny vision config with seeded random weights, saved to `ckpt`, and our
    three parts loaded back from that checkpoint."""
    ref = transformers.Qwen3OmniMoeForConditionalGeneration(transformers.Qwen3OmniMoeConfig(**vision_config_dict()))
    randomize_(ref.eval(), seed=seed)
    ref.save_pretrained(ckpt)
    return ref, load_turn_models(ckpt)
