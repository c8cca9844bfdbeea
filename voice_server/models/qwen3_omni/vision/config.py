"""Vision tower config, read from the `thinker_config.vision_config` block of the checkpoint's config.json.

Defaults are the RELEASED Qwen3-Omni-30B-A3B values. Sources: depth 27, hidden 1152, 16 heads, patch 16,
temporal patch 2, 2x2 merge, 2304 position entries, DeepStack taps [8, 16, 24] and output 2048 are in
the reference notes (/work/shared/reference/qwen3_omni.md, from the public config.json); intermediate
4304, `gelu_pytorch_tanh`, 3 input channels and the axial rope theta 10000 are transformers' class
defaults (the SigLIP2-So400M tower), confirmed by the parameter count: these sizes give 538,631,408
parameters, the released thinker's total minus our vision-less thinker (tests/models/qwen3_omni).
NOTE: transformers' class default `out_hidden_size` is 3584 (a Qwen2.5 leftover), not the released 2048.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from voice_server.models.hf_config import HFSection, as_section, check_positive, read_rope

# MLP activations the tower implements, by their transformers ACT2FN names.
VISION_ACTIVATIONS = ("gelu_pytorch_tanh", "gelu")


@dataclass(frozen=True)
class VisionEncoderConfig:
    depth: int = 27
    hidden_size: int = 1152
    intermediate_size: int = 4304
    num_heads: int = 16
    hidden_act: str = "gelu_pytorch_tanh"
    in_channels: int = 3
    patch_size: int = 16  # pixels per patch side
    temporal_patch_size: int = 2  # frames per patch (an image is its frame repeated by the processor)
    spatial_merge_size: int = 2  # merge x merge patches become one LLM token
    out_hidden_size: int = 2048  # the thinker's hidden size
    num_position_embeddings: int = 2304  # a square table (48 x 48), resampled to each grid
    deepstack_visual_indexes: tuple[int, ...] = (8, 16, 24)  # blocks whose outputs feed the DeepStack mergers
    rope_theta: float = 10000.0  # axial 2D rotary (transformers' `rope_parameters`, type "axial")

    def __post_init__(self) -> None:
        check_positive(
            self, "depth", "hidden_size", "intermediate_size", "num_heads", "in_channels", "patch_size",
            "temporal_patch_size", "spatial_merge_size", "out_hidden_size", "num_position_embeddings", "rope_theta",
        )
        if self.hidden_size % self.num_heads != 0:
            raise ValueError(
                f"VisionEncoderConfig.hidden_size={self.hidden_size} is not a multiple of num_heads={self.num_heads}"
            )
        if self.head_dim % 4 != 0:
            # NOTE: half of each head rotates by the row, half by the column, each in cos/sin pairs.
            raise ValueError(
                f"VisionEncoderConfig.hidden_size // num_heads = {self.head_dim} must be a multiple of 4 "
                "(2D rotary)"
            )
        if math.isqrt(self.num_position_embeddings) ** 2 != self.num_position_embeddings:
            raise ValueError(
                f"VisionEncoderConfig.num_position_embeddings={self.num_position_embeddings} is not a square "
                "(the learned positions are a square grid)"
            )
        indexes = self.deepstack_visual_indexes
        if len(set(indexes)) != len(indexes) or not all(0 <= i < self.depth for i in indexes):
            raise ValueError(
                f"VisionEncoderConfig.deepstack_visual_indexes={list(indexes)} must be distinct blocks in "
                f"[0, depth={self.depth})"
            )
        if self.hidden_act not in VISION_ACTIVATIONS:
            raise ValueError(
                f"VisionEncoderConfig.hidden_act={self.hidden_act!r} is not one of {VISION_ACTIVATIONS}"
            )

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def patch_dim(self) -> int:
        """Values per patch row of `pixel_values`: in_channels * temporal_patch_size * patch_size**2."""
        return self.in_channels * self.temporal_patch_size * self.patch_size**2

    @property
    def merged_hidden_size(self) -> int:
        """Width of one merge block (its spatial_merge_size**2 patches side by side) entering a merger."""
        return self.hidden_size * self.spatial_merge_size**2

    @property
    def num_grid_per_side(self) -> int:
        return math.isqrt(self.num_position_embeddings)

    @classmethod
    def from_hf_dict(cls, d: Mapping[str, Any] | HFSection) -> VisionEncoderConfig:
        s = as_section(d, "thinker_config.vision_config")
        kw = s.read_fields(cls, exclude=("rope_theta",))
        # NOTE: transformers turns a legacy "default" rope type into "axial" for this tower.
        kw["rope_theta"] = read_rope(s, cls.rope_theta, rope_types=("axial", "default")).theta
        return cls(**kw)
