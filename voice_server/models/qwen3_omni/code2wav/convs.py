"""Convolutional pieces of Code2Wav: causal convs, transposed convs, ConvNeXt, SnakeBeta decoder.

Sub-module and parameter names follow transformers' `Qwen3OmniMoeCode2Wav` so state dicts move
directly between the two. All modules work on channels-first tensors [B, C, T].
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class CausalConv(nn.Module):
    """Conv1d (stride 1) left-padded with zeros by its dilated receptive field: output t sees inputs <= t."""

    def __init__(self, in_channels: int, out_channels: int, kernel_size: int, dilation: int = 1,
                 groups: int = 1) -> None:
        super().__init__()
        self.conv = nn.Conv1d(in_channels, out_channels, kernel_size, dilation=dilation, groups=groups)
        self.left_pad = (kernel_size - 1) * dilation

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.conv(F.pad(x, (self.left_pad, 0)))


class CausalTransConv(nn.Module):
    """ConvTranspose1d trimmed by `kernel_size - stride` on both sides, as the reference does.

    NOTE: with kernel 2*stride (decoder blocks) output sample n sees inputs floor(n / stride) and
    floor(n / stride) + 1, and T inputs give (T - 1) * stride outputs: the last `stride` outputs,
    which would need input T, are trimmed. `keep_tail=True` keeps them (computed without input T);
    streaming emits them only at the end of a stream (see streaming.py).
    """

    def __init__(self, in_channels: int, out_channels: int, kernel_size: int, stride: int) -> None:
        super().__init__()
        self.conv = nn.ConvTranspose1d(in_channels, out_channels, kernel_size, stride=stride)
        self.trim = kernel_size - stride

    def forward(self, x: torch.Tensor, keep_tail: bool = False) -> torch.Tensor:
        x = self.conv(x)
        return x[..., self.trim : x.shape[-1] - (0 if keep_tail else self.trim)]


class SnakeBeta(nn.Module):
    """x + 1 / exp(beta) * sin^2(exp(alpha) * x), per channel (alpha, beta stored in log scale)."""

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.alpha = nn.Parameter(torch.zeros(channels))
        self.beta = nn.Parameter(torch.zeros(channels))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        alpha = torch.exp(self.alpha)[None, :, None]
        beta = torch.exp(self.beta)[None, :, None]
        return x + (1.0 / (beta + 1e-9)) * torch.pow(torch.sin(x * alpha), 2)


class ConvNeXtBlock(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.dwconv = CausalConv(dim, dim, kernel_size=7, groups=dim)
        self.norm = nn.LayerNorm(dim, eps=1e-6)
        self.pwconv1 = nn.Linear(dim, 4 * dim)
        self.pwconv2 = nn.Linear(4 * dim, dim)
        self.gamma = nn.Parameter(torch.full((dim,), 1e-6))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.dwconv(x).transpose(1, 2)
        h = self.pwconv2(F.gelu(self.pwconv1(self.norm(h))))
        return x + (self.gamma * h).transpose(1, 2)


class ResidualUnit(nn.Module):
    def __init__(self, dim: int, dilation: int) -> None:
        super().__init__()
        self.act1 = SnakeBeta(dim)
        self.conv1 = CausalConv(dim, dim, kernel_size=7, dilation=dilation)
        self.act2 = SnakeBeta(dim)
        self.conv2 = CausalConv(dim, dim, kernel_size=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.conv2(self.act2(self.conv1(self.act1(x))))


RESIDUAL_DILATIONS = (1, 3, 9)


class DecoderBlock(nn.Module):
    """SnakeBeta -> transposed conv (x `rate`, channels halved) -> residual units (dilations 1, 3, 9)."""

    def __init__(self, in_dim: int, rate: int) -> None:
        super().__init__()
        out_dim = in_dim // 2
        units: list[nn.Module] = [SnakeBeta(in_dim), CausalTransConv(in_dim, out_dim, 2 * rate, rate)]
        units += [ResidualUnit(out_dim, d) for d in RESIDUAL_DILATIONS]
        self.block = nn.ModuleList(units)

    def forward(self, x: torch.Tensor, keep_tail: bool = False) -> torch.Tensor:
        for unit in self.block:
            x = unit(x, keep_tail) if isinstance(unit, CausalTransConv) else unit(x)
        return x
