"""Vision tower of the Qwen3-Omni thinker (HF `Qwen3OmniMoeVisionEncoder`, `thinker.visual`).

Each patch row (temporal_patch_size frames of patch_size^2 pixels, 3 channels) is embedded by the
patch Conv3d, gets the learned position table bilinearly resampled to its frame's grid, and goes
through `depth` pre-norm ViT blocks with the axial 2D rotary; attention never crosses a frame. The
final merger (LayerNorm -> concat each merge x merge block -> MLP) makes one thinker token per block;
the DeepStack mergers (concat -> LayerNorm -> MLP) do the same to the outputs of the blocks in
`deepstack_visual_indexes`, and the thinker adds those to its hidden states at the image positions
after its first decoder layers (one feature per layer, in block order).

Parameter names equal the transformers in-memory names (checkpoint `thinker.visual.*`). No buffers
(the rotary table is computed per call from the grid), so meta-device construction is safe.

Cost at the released sizes: the blocks' linears are ~0.82 GFLOP per patch, attention adds
4 * frame_len * hidden FLOP per patch and block; a 448 x 448 image (28 x 28 patches, 196 tokens) is
~0.77 TFLOP, ~10% of it attention and ~6% the four mergers. Attention runs frame by frame (one fused SDPA
call per frame and block): O(sum of frame_len^2) compute in O(frame_len) memory, where one block-diagonal
masked call over a packed batch would cost O(num_patches^2) and materialise the mask.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from voice_server.models.layers import rotate_half
from voice_server.models.qwen3_omni.vision.config import VisionEncoderConfig
from voice_server.models.qwen3_omni.vision.grid import Grid, PatchGrid, patch_grid, position_taps, rotary_cos_sin
from voice_server.models.shapes import FLOATING, INTEGER, expect_shapes

_LAYER_NORM_EPS = 1e-6  # NOTE: fixed in the reference (not a config field)


class VisionOutput(NamedTuple):
    embeds: torch.Tensor  # [num_merged_tokens, out_hidden_size]: the thinker's image/video placeholder embeds
    deepstack: list[torch.Tensor]  # one [num_merged_tokens, out_hidden_size] per DeepStack block, in block order


class PatchEmbed(nn.Module):
    def __init__(self, cfg: VisionEncoderConfig) -> None:
        super().__init__()
        kernel = (cfg.temporal_patch_size, cfg.patch_size, cfg.patch_size)
        self.proj = nn.Conv3d(cfg.in_channels, cfg.hidden_size, kernel_size=kernel, stride=kernel, bias=True)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """[num_patches, patch_dim] -> [num_patches, hidden_size]."""
        # NOTE: a Conv3d whose kernel is its whole input is a matmul by the flattened kernel (the same
        # channel-major layout as the patch row): one GEMM, without the conv's im2col copy or cuDNN's TF32.
        weight = self.proj.weight.view(self.proj.out_channels, -1)
        return F.linear(pixel_values.to(weight.dtype), weight, self.proj.bias)


class VisionAttention(nn.Module):
    def __init__(self, cfg: VisionEncoderConfig) -> None:
        super().__init__()
        self.num_heads, self.head_dim = cfg.num_heads, cfg.head_dim
        self.qkv = nn.Linear(cfg.hidden_size, 3 * cfg.hidden_size)
        self.proj = nn.Linear(cfg.hidden_size, cfg.hidden_size)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, frame_lens: list[int]) -> torch.Tensor:
        """x [N, hidden], cos/sin [N, 1, head_dim] fp32; full attention inside each frame, none across."""
        n = x.shape[0]
        q, k, v = self.qkv(x).view(n, 3, self.num_heads, self.head_dim).unbind(1)  # each [N, heads, head_dim]
        # NOTE: rotated in fp32 and cast back, as the reference does (bf16 angles would lose positions).
        q, k = ((t.float() * cos + rotate_half(t.float()) * sin).to(x.dtype) for t in (q, k))
        q, k, v = (t.transpose(0, 1) for t in (q, k, v))  # [heads, N, head_dim]
        # NOTE: [1, heads, L, d] (4-D), as transformers' sdpa path calls it: on CPU that takes the fused flash
        # kernel (blockwise, never the [heads, L, L] scores: 2.2 GiB at a 1024^2 image in the 3-D math path)
        # and on CUDA the flash / memory-efficient ones.
        outs = [
            F.scaled_dot_product_attention(qf[None], kf[None], vf[None])[0]
            for qf, kf, vf in zip(q.split(frame_lens, 1), k.split(frame_lens, 1), v.split(frame_lens, 1))
        ]
        return self.proj(torch.cat(outs, dim=1).transpose(0, 1).reshape(n, -1))


class VisionMLP(nn.Module):
    def __init__(self, cfg: VisionEncoderConfig) -> None:
        super().__init__()
        self.linear_fc1 = nn.Linear(cfg.hidden_size, cfg.intermediate_size)
        self.linear_fc2 = nn.Linear(cfg.intermediate_size, cfg.hidden_size)
        self.approximate = "tanh" if cfg.hidden_act == "gelu_pytorch_tanh" else "none"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_fc2(F.gelu(self.linear_fc1(x), approximate=self.approximate))


class VisionBlock(nn.Module):
    def __init__(self, cfg: VisionEncoderConfig) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(cfg.hidden_size, eps=_LAYER_NORM_EPS)
        self.norm2 = nn.LayerNorm(cfg.hidden_size, eps=_LAYER_NORM_EPS)
        self.attn = VisionAttention(cfg)
        self.mlp = VisionMLP(cfg)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, frame_lens: list[int]) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), cos, sin, frame_lens)
        return x + self.mlp(self.norm2(x))


class PatchMerger(nn.Module):
    """merge x merge patches -> one thinker token. The final merger normalises each patch before joining
    the block (`is_postshuffle_norm` False); the DeepStack mergers normalise the joined block."""

    def __init__(self, cfg: VisionEncoderConfig, is_postshuffle_norm: bool) -> None:
        super().__init__()
        self.merged_hidden_size = cfg.merged_hidden_size
        self.is_postshuffle_norm = is_postshuffle_norm
        norm_size = cfg.merged_hidden_size if is_postshuffle_norm else cfg.hidden_size
        self.ln_q = nn.LayerNorm(norm_size, eps=_LAYER_NORM_EPS)
        self.mlp = nn.Sequential(  # NOTE: indices 0 and 2 are the checkpoint's `mlp.0` / `mlp.2`
            nn.Linear(cfg.merged_hidden_size, cfg.merged_hidden_size),
            nn.GELU(),
            nn.Linear(cfg.merged_hidden_size, cfg.out_hidden_size),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """[N, hidden] (blocks of merge**2 consecutive patches) -> [N / merge**2, out_hidden_size]."""
        if self.is_postshuffle_norm:
            return self.mlp(self.ln_q(x.reshape(-1, self.merged_hidden_size)))
        return self.mlp(self.ln_q(x).reshape(-1, self.merged_hidden_size))


class VisionEncoder(nn.Module):
    def __init__(self, cfg: VisionEncoderConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.patch_embed = PatchEmbed(cfg)
        self.pos_embed = nn.Embedding(cfg.num_position_embeddings, cfg.hidden_size)
        self.blocks = nn.ModuleList([VisionBlock(cfg) for _ in range(cfg.depth)])
        self.merger = PatchMerger(cfg, is_postshuffle_norm=False)
        self.merger_list = nn.ModuleList(
            [PatchMerger(cfg, is_postshuffle_norm=True) for _ in cfg.deepstack_visual_indexes]
        )

    def num_tokens(self, grid_thw: torch.Tensor) -> list[int]:
        """Thinker tokens (placeholders) of each item: t * h * w / merge**2."""
        return [t * h * w // self.cfg.spatial_merge_size**2 for t, h, w in _grids(grid_thw)]

    def forward(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> VisionOutput:
        """pixel_values [num_patches, patch_dim] (items packed as the processor lays them out, see
        `grid.py`), grid_thw [num_items, 3] (t, h, w in patches) -> embeds and DeepStack features, each
        [num_patches / merge**2, out_hidden_size], items one after another."""
        cfg = self.cfg
        expect_shapes(
            ("pixel_values", pixel_values, "[num_patches, patch_dim]", FLOATING),
            ("grid_thw", grid_thw, "[num_items, 3]", INTEGER), dims={"patch_dim": cfg.patch_dim},
        )
        grids = _grids(grid_thw)
        _check_grids(grids, pixel_values.shape[0], cfg.spatial_merge_size)
        grid: PatchGrid = patch_grid(grids, cfg.spatial_merge_size, pixel_values.device)
        x = self.patch_embed(pixel_values)
        indices, weights = position_taps(grid, cfg.num_grid_per_side)
        # NOTE: fp32 weights, so a bf16 table is summed in fp32 and cast once (as the reference does).
        x = x + (self.pos_embed(indices) * weights[:, :, None]).sum(1).to(x.dtype)
        cos, sin = (t[:, None, :] for t in rotary_cos_sin(grid, cfg.head_dim, cfg.rope_theta))  # [N, 1, head_dim]
        deepstack: list[torch.Tensor] = []
        for layer_idx, block in enumerate(self.blocks):
            x = block(x, cos, sin, grid.frame_lens)
            if layer_idx in cfg.deepstack_visual_indexes:
                # NOTE: the merger is the one at the index's list position; features come in block order.
                deepstack.append(self.merger_list[cfg.deepstack_visual_indexes.index(layer_idx)](x))
        return VisionOutput(self.merger(x), deepstack)


def _grids(grid_thw: torch.Tensor) -> list[Grid]:
    # NOTE: one host read of a [num_items, 3] tensor; everything per patch is then built on the device.
    return [(int(t), int(h), int(w)) for t, h, w in grid_thw.tolist()]


def _check_grids(grids: list[Grid], num_patches: int, merge: int) -> None:
    for item, (t, h, w) in enumerate(grids):
        if min(t, h, w) < 1 or h % merge or w % merge:
            raise ValueError(
                f"grid_thw[{item}]=({t}, {h}, {w}): t, h, w must be >= 1 and h, w multiples of "
                f"spatial_merge_size={merge}"
            )
    expected = sum(t * h * w for t, h, w in grids)
    if expected != num_patches:
        raise ValueError(f"pixel_values has {num_patches} patches but grid_thw implies {expected}")
