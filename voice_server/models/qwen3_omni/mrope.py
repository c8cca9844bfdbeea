"""Interleaved multimodal RoPE (M-RoPE) of the Qwen3-Omni thinker and talker.

3-axis (t, h, w) positions; layers.py has only 1-D RoPE. Frequency slot i takes its angle from
the t, h or w position: slots 1, 4, 7, .. (< 3 * section[1]) use h, slots 2, 5, 8, .. (< 3 * section[2])
use w, every other slot uses t (transformers' `recomposition_frequencies`).
"""

from __future__ import annotations

import torch

from voice_server.models.layers import rope_cos_sin, rope_inv_freq


def mrope_axis_index(head_dim: int, mrope_section: tuple[int, ...]) -> torch.Tensor:
    """Which position axis (0 = t, 1 = h, 2 = w) drives each of the head_dim // 2 frequency slots."""
    axis = torch.zeros(head_dim // 2, dtype=torch.long)
    for dim, offset in ((1, 1), (2, 2)):
        axis[offset : mrope_section[dim] * 3 : 3] = dim
    return axis


def as_mrope_positions(positions: torch.Tensor) -> torch.Tensor:
    """[B, L] text positions (all three axes equal) or [3, B, L] -> [3, B, L]."""
    if positions.ndim == 2:
        return positions.unsqueeze(0).expand(3, -1, -1)
    if positions.ndim != 3 or positions.shape[0] != 3:
        raise ValueError(f"positions must be [B, L] or [3, B, L], got {tuple(positions.shape)}")
    return positions


class MRoPE(torch.nn.Module):
    # NOTE: tables are cached per device instead of registered as buffers, so a model built on the
    # meta device and then loaded with `assign=True` never keeps meta-valued rope tables.
    def __init__(self, head_dim: int, theta: float, mrope_section: tuple[int, ...]) -> None:
        super().__init__()
        self.head_dim, self.theta, self.mrope_section = head_dim, theta, mrope_section
        self._tables: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}

    def _table(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        if device not in self._tables:
            inv_freq = rope_inv_freq(self.head_dim, self.theta)
            axis = mrope_axis_index(self.head_dim, self.mrope_section)
            self._tables[device] = (inv_freq.to(device), axis.to(device))
        return self._tables[device]

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [B, L] or [3, B, L] -> cos, sin [B, L, head_dim]."""
        pos = as_mrope_positions(positions)
        inv_freq, axis = self._table(pos.device)
        angles = pos.to(torch.float32)[..., None] * inv_freq  # [3, B, L, D/2]
        index = axis.expand(1, *angles.shape[1:])
        return rope_cos_sin(angles.gather(0, index).squeeze(0), dtype)
