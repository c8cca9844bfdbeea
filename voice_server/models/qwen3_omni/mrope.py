"""Interleaved multimodal RoPE (M-RoPE) of the Qwen3-Omni thinker and talker.

3-axis (t, h, w) positions; layers.py has only 1-D RoPE. Frequency slot i takes its angle from
the t, h or w position: slots 1, 4, 7, .. (< 3 * section[1]) use h, slots 2, 5, 8, .. (< 3 * section[2])
use w, every other slot uses t (transformers' `recomposition_frequencies`).

Positions are int64, or float32 where a video's frame times are fractional (`thinker/rope.py`); either
way the angles are float32 position x float32 inverse frequency, as transformers computes them.
"""

from __future__ import annotations

import torch

from voice_server.models.layers import rope_cos_sin, rope_inv_freq, signed_sin

# NOTE: float32 only when a video's frame times are fractional; text-only steps are int64.
POSITION_DTYPES = (torch.int64, torch.float32)


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
        self._signed_tables: dict[tuple[torch.device, torch.dtype], tuple[torch.Tensor, torch.Tensor]] = {}

    def _table(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        if device not in self._tables:
            inv_freq = rope_inv_freq(self.head_dim, self.theta)
            axis = mrope_axis_index(self.head_dim, self.mrope_section)
            self._tables[device] = (inv_freq.to(device), axis.to(device))
        return self._tables[device]

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [B, L] or [3, B, L] (int64 or float32) -> cos, sin [B, L, head_dim]."""
        pos = as_mrope_positions(positions)
        inv_freq, axis = self._table(pos.device)
        angles = pos.to(torch.float32)[..., None] * inv_freq  # [3, B, L, D/2]
        index = axis.expand(1, *angles.shape[1:])
        return rope_cos_sin(angles.gather(0, index).squeeze(0), dtype)

    def signed_table(
        self, num_positions: int, device: torch.device, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and `signed_sin` [num_positions, head_dim] for positions equal on all three axes (text
        and audio), computed once per device and dtype (rebuilt if a longer table is asked for).

        NOTE: the paged path indexes this table rather than computing cos/sin per step, so a row's
        values cannot depend on how many rows the step has (as Llama's `signed_rope_table`).
        """
        table = self._signed_tables.get((device, dtype))
        if table is None or table[0].shape[0] < num_positions:
            cos, sin = self(torch.arange(num_positions, device=device)[None], dtype)
            table = self._signed_tables[device, dtype] = (cos[0], signed_sin(sin[0]))
        return table

    def paged_cos_sin(
        self, positions: torch.Tensor, num_positions: int, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Flat positions [T] int64 (all axes equal) or [3, T] int64 / float32 -> cos and `signed_sin`
        [1, 1, T, head_dim], the layout the paged `Attention` path broadcasts over heads (`apply_rotary_signed`)."""
        if positions.ndim == 1:
            cos_table, sin_table = self.signed_table(num_positions, positions.device, dtype)
            cos, sin = cos_table[positions], sin_table[positions]
        else:
            # NOTE: distinct t/h/w positions (images, videos; float32 for fractional video times) per step.
            cos3, sin3 = self(positions[:, None], dtype)
            cos, sin = cos3[0], signed_sin(sin3[0])
        return cos[None, None], sin[None, None]
