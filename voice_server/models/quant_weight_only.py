"""Weight-only quantised modules over torch's own CPU kernels, and the Q8_0 embedding.

- `Int8Linear`: int8 weights with one scale per output channel, bf16 activations through
  `aten._weight_int8pack_mm` (the input is cast to bf16, the output back to the caller's dtype).
- `Int4Linear`: 4-bit weights in groups of 32 along the input axis, `weight = (q - 8) * scale + zero`
  with q in 0..15, through `aten._weight_int4pack_mm_for_cpu` (bf16 activations, same casts).
- `QuantEmbedding`: an int8 lookup table with one scale per 32 values of a row (exactly GGUF Q8_0),
  dequantising only the looked-up rows; it stands in for a tied embedding once `lm_head` is quantised.

Apart from the int8-activation modules (`quant_w8a8.py`, `quant_w4a8.py`, exactly batch invariant)
because these read bf16 activations through torch's kernels; `voice_server/models/quant.py` picks
among all of them and rewrites a model with them.

GGUF blocks that map exactly are used as is: Q4_1 (`d * q + m` per 32) is `Int4Linear` with
`scale = d`, `zero = m + 8 * d` (only the bf16 rounding of d and m changes anything); Q8_0 is
`QuantEmbedding` unchanged. Q8_0 -> `Int8Linear` has to requantise (per 32 -> per row): the block
values `d * q` are rebuilt in fp32 and quantised symmetrically per row (`scale = max|w| / 127`),
so each weight moves by at most half a row step on top of Q8_0's own error.
"""

from __future__ import annotations

import torch
from torch import nn

from voice_server.models.gguf_blocks import GROUP_SIZE, q4_1_unpack, q8_0_unpack
from voice_server.models.quant_w8a8 import PerChannelInt8Linear


def quantize_int4_groups(
    weight: torch.Tensor, group_size: int = GROUP_SIZE
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Asymmetric min/max 4-bit per group of `group_size` along K.

    Returns (q int32 [N, K] in 0..15, scales [N, K // g], zeros [N, K // g]), both fp32 holding
    bf16-representable values, with weight ~ (q - 8) * scale + zero.
    """
    n, k = weight.shape
    if k % group_size:
        raise ValueError(f"in_features={k} is not a multiple of group_size={group_size}")
    w = weight.detach().float().reshape(n, k // group_size, group_size)
    lo, hi = w.amin(dim=-1), w.amax(dim=-1)
    scales = ((hi - lo) / 15.0).to(torch.bfloat16).float()
    safe = torch.where(scales > 0, scales, torch.ones_like(scales))
    zeros = (lo + 8.0 * scales).to(torch.bfloat16).float()
    q = torch.round((w - zeros[..., None]) / safe[..., None] + 8.0).clamp(0, 15).to(torch.int32)
    return q.reshape(n, k), scales, zeros


def _check_q4_shape(out_features: int, in_features: int, group_size: int) -> None:
    if in_features % group_size or out_features % 16:
        raise ValueError(
            f"int4 needs in_features % {group_size} == 0 and out_features % 16 == 0, "
            f"got [{out_features}, {in_features}]"
        )


def _float_bias(bias: torch.Tensor | None) -> torch.Tensor | None:
    return None if bias is None else bias.detach().float().clone()


class Int8Linear(PerChannelInt8Linear):
    """y = x @ (q * scale[:, None]).T + bias with int8 q [N, K]; bf16 activations inside."""

    scale_dtype = torch.bfloat16  # NOTE: `_weight_int8pack_mm` takes its scales in the activation dtype

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        out = torch.ops.aten._weight_int8pack_mm(
            x.reshape(-1, self.in_features).to(torch.bfloat16), self.qweight, self.scales
        )
        out = out.to(x.dtype)
        if self.bias is not None:
            out = out + self.bias.to(x.dtype)
        return out.view(*shape[:-1], self.out_features)


class Int4Linear(nn.Module):
    """y = x @ W.T + bias, W = (q - 8) * scale + zero per group of 32 along K; bf16 activations."""

    in_features: int
    out_features: int
    qweight: torch.Tensor
    scales_and_zeros: torch.Tensor
    bias: torch.Tensor | None

    def __init__(
        self,
        q: torch.Tensor,
        scales: torch.Tensor,
        zeros: torch.Tensor,
        bias: torch.Tensor | None = None,
        group_size: int = GROUP_SIZE,
    ) -> None:
        """q int [N, K] in 0..15; scales/zeros [N, K // group_size] (rounded to bf16 here)."""
        super().__init__()
        n, k = q.shape
        _check_q4_shape(n, k, group_size)
        if scales.shape != (n, k // group_size) or zeros.shape != scales.shape:
            raise ValueError(f"scales/zeros must be [{n}, {k // group_size}], got {tuple(scales.shape)}")
        self.out_features, self.in_features, self.group_size = n, k, group_size
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.to(torch.int32).contiguous(), 1)
        sz = torch.stack((scales.detach(), zeros.detach()), dim=-1).transpose(0, 1).to(torch.bfloat16)
        self.register_buffer("qweight", packed)
        self.register_buffer("scales_and_zeros", sz.contiguous())
        self.register_buffer("bias", _float_bias(bias))

    @classmethod
    def from_float(
        cls, weight: torch.Tensor, bias: torch.Tensor | None = None, group_size: int = GROUP_SIZE
    ) -> Int4Linear:
        q, scales, zeros = quantize_int4_groups(weight, group_size)
        return cls(q, scales, zeros, bias, group_size)

    @classmethod
    def from_q4_1(cls, raw: object, bias: torch.Tensor | None = None) -> Int4Linear:
        """Exactly GGUF Q4_1 rows [N, K // 32 * 20]: scale = d, zero = m + 8 d (then bf16)."""
        q, d, m = q4_1_unpack(raw)
        return cls(q, d, m + 8.0 * d, bias, GROUP_SIZE)

    def unpack(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(q int32 [N, K], scales fp32 [N, K // g], zeros fp32 [N, K // g]) back from the packed form.

        NOTE: the packed layout is the kernel's own; q is read back through the kernel itself with
        unit scales and zero offsets (identity input, outputs q - 8, exact in bf16)."""
        groups = self.in_features // self.group_size
        unit = torch.zeros(groups, self.out_features, 2, dtype=torch.bfloat16)
        unit[..., 0] = 1.0
        eye = torch.eye(self.in_features, dtype=torch.bfloat16)
        q_minus_8 = torch.ops.aten._weight_int4pack_mm_for_cpu(eye, self.qweight, self.group_size, unit)
        q = (q_minus_8.float().t() + 8.0).round().to(torch.int32)
        sz = self.scales_and_zeros.float().transpose(0, 1)
        return q.contiguous(), sz[..., 0].contiguous(), sz[..., 1].contiguous()

    def dequantize(self) -> torch.Tensor:
        """The fp32 weight [N, K] the kernel multiplies by (from the bf16 scales and zeros)."""
        q, scales, zeros = self.unpack()
        g = self.group_size
        w = (q.float() - 8.0).reshape(self.out_features, -1, g) * scales[..., None] + zeros[..., None]
        return w.reshape(self.out_features, self.in_features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        out = torch.ops.aten._weight_int4pack_mm_for_cpu(
            x.reshape(-1, self.in_features).to(torch.bfloat16), self.qweight, self.group_size, self.scales_and_zeros
        )
        out = out.to(x.dtype)
        if self.bias is not None:
            out = out + self.bias.to(x.dtype)
        return out.view(*shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"group_size={self.group_size}, bias={self.bias is not None}"
        )


class QuantEmbedding(nn.Module):
    """Lookup table of int8 rows with one fp32 scale per 32 values (GGUF Q8_0 exactly).

    Only the looked-up rows are dequantised; `dtype` is the output dtype."""

    qweight: torch.Tensor
    scales: torch.Tensor

    def __init__(self, qweight: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.num_embeddings, self.embedding_dim = qweight.shape
        if self.embedding_dim % GROUP_SIZE or scales.shape != (self.num_embeddings, self.embedding_dim // GROUP_SIZE):
            raise ValueError(f"bad QuantEmbedding shapes {tuple(qweight.shape)} / {tuple(scales.shape)}")
        self.register_buffer("qweight", qweight.to(torch.int8).contiguous())
        self.register_buffer("scales", scales.float().contiguous())
        self.dtype = dtype

    @classmethod
    def from_float(cls, weight: torch.Tensor, dtype: torch.dtype = torch.float32) -> QuantEmbedding:
        v, dim = weight.shape
        w = weight.detach().float().reshape(v, dim // GROUP_SIZE, GROUP_SIZE)
        scales = w.abs().amax(dim=-1) / 127.0
        safe = torch.where(scales > 0, scales, torch.ones_like(scales))
        q = torch.round(w / safe[..., None]).clamp(-127, 127).to(torch.int8)
        return cls(q.reshape(v, dim), scales, dtype)

    @classmethod
    def from_q8_0(cls, raw: object, dtype: torch.dtype = torch.float32) -> QuantEmbedding:
        q, d = q8_0_unpack(raw)
        return cls(q, d, dtype)

    def dequantize(self) -> torch.Tensor:
        v, dim = self.qweight.shape
        return (self.qweight.float().reshape(v, -1, GROUP_SIZE) * self.scales[..., None]).reshape(v, dim)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        q = self.qweight[ids].float()
        rows = q.view(*ids.shape, -1, GROUP_SIZE) * self.scales[ids].unsqueeze(-1)
        return rows.view(*ids.shape, self.embedding_dim).to(self.dtype)
