"""W8A8: int8 weights and int8 activations through `torch._int_mm` (int32 accumulation).

- Weights: symmetric int8 per output channel, `w ~ q * col_scale` (fp32 scales, no bf16 rounding).
- Activations: quantised per ROW at run time, `row_scale = max|x_row| / 127`, `q = round(x / row_scale)`
  (round half to even, `torch.round`), an all-zero row gets a tiny scale and stays zero.
- `y = (q_x @ q_w.T) * row_scale * col_scale (+ bias)`, in the caller's dtype.

Batch invariance is exact by construction: a row's scale depends on that row only, the int32
accumulation is exact whatever kernel the row count selects, and the dequantisation is elementwise
plain multiplies (no FMA, whose use could differ between a vector body and its tail). So a row gets
the same bits for every M; `probe_row_plan` finds no padding needed for these modules.

`_int_mm` kernels (oneDNN s8s8->s32 on CPU; measured on an EPYC with AVX512-VNNI, 1 thread, µs):
with the weight stored [N, K] and passed as the transposed view, M=1 takes a GEMV path (1728x576:
8.8, vs 24 with a contiguous [K, N] weight); M>=2 takes a GEMM that costs about as much at M=2 as
at M=8 (27 .. 38), so two rows run as two GEMVs (22). Per-row activation quantisation is ~7 small
ops (~7 µs at M=1); `linalg.vector_norm(inf)` was slower than `abs().amax()` (13 vs 2.5 µs at M=8).

From GGUF: Q8_0 (one fp16 scale per 32) and Q4_1 (`d * q + m` per 32) are dequantised to fp32 and
requantised symmetrically per output row, so each weight moves by at most half a row step
(`max|w_row| / 254`) on top of the block format's own error.
"""

from __future__ import annotations

from typing import TypeVar

import torch
from torch import nn

from voice_server.models.gguf_blocks import q4_1_dequantize, q8_0_dequantize

_Linear = TypeVar("_Linear", bound="PerChannelInt8Linear")
_TINY_SCALE = 1e-30
"""Floor of a row's activation scale: an all-zero row quantises to zeros (no 0/0)."""
_GEMV_ROWS = 2
"""Up to this many rows, one `_int_mm` GEMV per row beats the M>=2 GEMM kernel (measured)."""


def quantize_int8_rows(
    weight: torch.Tensor, scale_dtype: torch.dtype = torch.float32
) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8 per row: (q int8 [N, K], scales fp32 [N]) with weight ~ q * scales[:, None].

    The scales are rounded to `scale_dtype` first (the kernel's precision) so q is chosen against them."""
    w = weight.detach().float()
    scales = (w.abs().amax(dim=1) / 127.0).to(scale_dtype).float()
    scales = torch.where(scales > 0, scales, torch.ones_like(scales))
    q = torch.round(w / scales[:, None]).clamp_(-127, 127).to(torch.int8)
    return q, scales


def quantize_activation_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 [M, K] -> (q int8 [M, K], row_scale fp32 [M, 1]); each row on its own (batch invariant)."""
    scale = x.abs().amax(dim=1, keepdim=True).div_(127.0).clamp_min_(_TINY_SCALE)
    return torch.div(x, scale).round_().to(torch.int8), scale


class PerChannelInt8Linear(nn.Module):
    """int8 weights [N, K] with one scale per output channel (`scale_dtype`) and an fp32 bias: the
    storage `Int8Linear` (weight-only) and `W8A8Linear` share."""

    scale_dtype = torch.float32
    in_features: int
    out_features: int
    qweight: torch.Tensor
    scales: torch.Tensor
    bias: torch.Tensor | None

    def __init__(self, qweight: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        super().__init__()
        if qweight.dtype != torch.int8 or qweight.dim() != 2:
            raise ValueError(f"qweight must be int8 [N, K], got {qweight.dtype} {tuple(qweight.shape)}")
        self.out_features, self.in_features = qweight.shape
        if scales.shape != (self.out_features,):
            raise ValueError(f"scales must be [{self.out_features}], got {tuple(scales.shape)}")
        self.register_buffer("qweight", qweight.contiguous())
        self.register_buffer("scales", scales.detach().to(self.scale_dtype).contiguous())
        self.register_buffer("bias", None if bias is None else bias.detach().float().clone())

    @classmethod
    def from_float(cls: type[_Linear], weight: torch.Tensor, bias: torch.Tensor | None = None) -> _Linear:
        q, scales = quantize_int8_rows(weight, cls.scale_dtype)
        return cls(q, scales, bias)

    @classmethod
    def from_q8_0(cls: type[_Linear], raw: object, bias: torch.Tensor | None = None) -> _Linear:
        """GGUF Q8_0 rows, requantised per 32 -> per row (see the module docstring)."""
        return cls.from_float(q8_0_dequantize(raw), bias)

    def dequantize(self) -> torch.Tensor:
        """The fp32 weight [N, K] the kernel multiplies by (int8 values times their row's scale)."""
        return self.qweight.float() * self.scales.float()[:, None]

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


class W8A8Linear(PerChannelInt8Linear):
    """y = rowquant(x) @ q.T * row_scale * col_scale + bias, int8 q [N, K] per output channel."""

    @classmethod
    def from_q4_1(cls, raw: object, bias: torch.Tensor | None = None) -> W8A8Linear:
        """GGUF Q4_1 rows, dequantised and requantised to int8 per row."""
        return cls.from_float(q4_1_dequantize(raw), bias)

    def int_matmul(self, qx: torch.Tensor) -> torch.Tensor:
        """int8 [M, K] @ qweight.T -> int32 [M, N], exact (the kernel depends on M, the bits do not)."""
        weight_t = self.qweight.t()
        if 1 < qx.shape[0] <= _GEMV_ROWS:
            return torch.cat([torch._int_mm(qx[i : i + 1], weight_t) for i in range(qx.shape[0])])
        return torch._int_mm(qx, weight_t)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        rows = x.reshape(-1, self.in_features)
        if rows.dtype != torch.float32:
            rows = rows.float()
        qx, row_scale = quantize_activation_rows(rows)
        # NOTE: two plain multiplies (int32 * fp32 promotes), not addcmul: see the module docstring.
        out = torch.mul(self.int_matmul(qx), row_scale).mul_(self.scales)
        if self.bias is not None:
            out = out.add_(self.bias)
        return out.to(x.dtype).view(*shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


__all__ = ["W8A8Linear", "quantize_activation_rows", "quantize_int8_rows"]
