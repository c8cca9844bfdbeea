"""What a packed vision batch's `grid_thw` implies, per patch: rotary angles, position-table taps, segments.

Patch layout (the processor's): items (images, videos) one after another, each frame after frame,
and inside a frame in spatial-merge-block order: the merge x merge patches of one block are consecutive,
blocks in raster order. So a merger's `view(-1, hidden * merge**2)` gathers exactly one block, and one
LLM token comes from each block.

Everything here is computed from `grid_thw` alone, like transformers' `vision_utils` helpers
(`get_vision_position_ids`, `get_vision_interpolation_indices_and_weights`, `get_vision_cu_seqlens`),
in fp32 with the same operations, so the results are bitwise the reference's.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from voice_server.models.layers import rope_inv_freq

Grid = tuple[int, int, int]  # (t, h, w): frames (after temporal patching) and patch rows / columns


@dataclass(frozen=True)
class PatchGrid:
    rows: torch.Tensor  # [num_patches] int64: patch row inside its frame
    cols: torch.Tensor  # [num_patches] int64: patch column inside its frame
    heights: torch.Tensor  # [num_patches] int64: its frame's grid height h
    widths: torch.Tensor  # [num_patches] int64: its frame's grid width w
    frame_lens: list[int]  # patches of each frame, item after item: the attention segments


def patch_grid(grids: list[Grid], merge: int, device: torch.device | str = "cpu") -> PatchGrid:
    """Row / column of every patch of the packed batch (see the module note for the order)."""
    rows, cols, heights, widths, frame_lens = [], [], [], [], []
    for t, h, w in grids:
        i = torch.arange(h * w, device=device)
        blocks_per_row = w // merge
        block_row, block_col = i // (merge * merge * blocks_per_row), (i // (merge * merge)) % blocks_per_row
        rows.append((block_row * merge + (i // merge) % merge).repeat(t))
        cols.append((block_col * merge + i % merge).repeat(t))
        heights.append(torch.full((t * h * w,), h, device=device))
        widths.append(torch.full((t * h * w,), w, device=device))
        frame_lens += [h * w] * t
    return PatchGrid(torch.cat(rows), torch.cat(cols), torch.cat(heights), torch.cat(widths), frame_lens)


def rotary_cos_sin(grid: PatchGrid, head_dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos / sin [num_patches, head_dim] fp32 of the axial 2D rotary: the first quarter of the angles
    follows the row, the second the column, and the half-split layout repeats both halves."""
    inv_freq = rope_inv_freq(head_dim // 2, theta).to(grid.rows.device)  # [head_dim // 4]
    angles = torch.cat((grid.rows.float()[:, None] * inv_freq, grid.cols.float()[:, None] * inv_freq), dim=-1)
    emb = torch.cat((angles, angles), dim=-1)
    return emb.cos(), emb.sin()


def _axis_taps(index: torch.Tensor, size: torch.Tensor, side: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Two taps into a `side`-long table axis and their weights, per position `index` of an axis of
    length `size` (bilinear, align_corners=True: the ends map to 0 and side - 1)."""
    # NOTE: the reference's closed form of linspace(0, side - 1, size)[index], op for op (bitwise equal).
    src = index.to(torch.float32) * (side - 1) / torch.clamp(size - 1, min=1)
    floor = torch.floor(src)
    offsets = torch.arange(0, 2, device=index.device)
    taps = (floor.long()[:, None] + offsets).clamp(0, side - 1)
    weights = (1 - (src[:, None] - floor[:, None] - offsets).abs()).clamp(min=0)
    return taps, weights


def position_taps(grid: PatchGrid, side: int) -> tuple[torch.Tensor, torch.Tensor]:
    """indices [num_patches, 4] int64 into the flattened side x side position table and their bilinear
    weights [num_patches, 4] fp32: the table resampled to each frame's h x w grid."""
    row_taps, row_weights = _axis_taps(grid.rows, grid.heights, side)
    col_taps, col_weights = _axis_taps(grid.cols, grid.widths, side)
    indices = (row_taps[:, :, None] * side + col_taps[:, None, :]).reshape(-1, 4)
    weights = (row_weights[:, :, None] * col_weights[:, None, :]).reshape(-1, 4)
    return indices, weights
