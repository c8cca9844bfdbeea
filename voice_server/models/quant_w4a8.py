"""W4A8 (and its 8-bit twin): block-quantised weights times int8 activations, llama.cpp's math.

- Weights in blocks of 32 along K, as GGUF stores them: `W4A8Linear` is Q4_1 (`w = d * q + m`,
  q in 0..15), `Q8A8Linear` is Q8_0 (`w = d * q`, q in -127..127); d and m are fp16, exactly the
  file's, so a GGUF loads without requantising.
- Activations quantised per row and per block of 32 at run time (llama.cpp's Q8_1):
  `sx = max|x| / 127`, `qx = round_half_even(x * (127 / max|x|))`, and the block sum of qx.
- Per block, an exact integer dot product: `y = sum_b d * sx * dot(q, qx) + m * (sx * sum(qx))`.

The C++ op `torch.ops.voice_server.block_a8_linear` (`voice_server/kernels`) does it with
AVX512-VNNI or AVX2 integer dot products, reading each weight block once for every row of the step.
A row's result depends on that row only, computed in one fixed order: bit-identical for any row
count and thread count (`probe_row_plan` finds no padding needed). Without the
kernels, `reference_block_a8` computes the same math in torch (slow; tests and a last resort: the
loaders pick `int4` instead, `effective_mode`).
"""

from __future__ import annotations

from typing import ClassVar

import torch
from torch import nn

from voice_server import kernels
from voice_server.models.gguf_blocks import GROUP_SIZE, q4_1_unpack, q8_0_unpack

TILE_ROWS = 16
"""Output channels interleaved per block in the packed layout (one 64-byte vector per 4 K values)."""
DEFAULT_CREST = 4.0
"""Activation blocks with max|x| > 4 * mean|x| get a second int8 plane (`quantize_activation_blocks`).

NOTE: measured on SmolLM2-135M, fused layers, against fp32 on the same weights (12 prompts x 32
positions fed fp32's tokens; share of blocks with two planes; 8-stream tok/s at 1 thread): crest 5
top-1 0.990, mean |logit error| 0.061 (37%; 723); 4: 0.992, 0.050 (54%; 674); 3: 0.997, 0.027 (81%;
592); 2: 1.000, 0.002 (100%; 547). int8 alone (llama.cpp's Q8_1, crest < 0) lost the first token of
"What is the capital of France?"; so did crest 5 (a 0.08-logit near tie in fp32), crest 4 keeps it."""


def check_block_shape(out_features: int, in_features: int) -> None:
    if out_features % TILE_ROWS or in_features % GROUP_SIZE or out_features < 1 or in_features < 1:
        raise ValueError(
            f"w4a8 needs out_features % {TILE_ROWS} == 0 and in_features % {GROUP_SIZE} == 0, "
            f"got [{out_features}, {in_features}]"
        )


def _tiles(q: torch.Tensor) -> torch.Tensor:
    """uint8 [N, K] -> [N / 16, K / 32, 8, 16, 4]: per tile and block, K groups of 4 per channel."""
    n, k = q.shape
    return q.reshape(n // TILE_ROWS, TILE_ROWS, k // GROUP_SIZE, 8, 4).permute(0, 2, 3, 1, 4)


def _untile(t: torch.Tensor) -> torch.Tensor:
    num_tiles, num_blocks = t.shape[:2]
    return t.permute(0, 3, 1, 2, 4).reshape(num_tiles * TILE_ROWS, num_blocks * GROUP_SIZE)


def _tile_scales(s: torch.Tensor) -> torch.Tensor:
    """fp32 [N, K / 32] -> uint8 [N / 16, K / 32, 32] (16 fp16 per tile and block)."""
    n, num_blocks = s.shape
    tiled = s.to(torch.float16).reshape(n // TILE_ROWS, TILE_ROWS, num_blocks).transpose(1, 2).contiguous()
    return tiled.view(torch.uint8)


def _untile_scales(b: torch.Tensor) -> torch.Tensor:
    num_tiles, num_blocks = b.shape[:2]
    return b.contiguous().view(torch.float16).float().transpose(1, 2).reshape(num_tiles * TILE_ROWS, num_blocks)


def pack_q4(q: torch.Tensor, d: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    """q [N, K] in 0..15, d/m [N, K / 32] (rounded to fp16) -> uint8 [N / 16, K / 32, 320]."""
    t = _tiles(q.to(torch.uint8))
    nibbles = (t[:, :, :4] | (t[:, :, 4:] << 4)).reshape(*t.shape[:2], 256)
    return torch.cat((nibbles, _tile_scales(d), _tile_scales(m)), dim=-1).contiguous()


def unpack_q4(packed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Inverse of `pack_q4`: (q int32 [N, K], d fp32, m fp32)."""
    nibbles = packed[..., :256].reshape(*packed.shape[:2], 4, TILE_ROWS, 4)
    t = torch.cat((nibbles & 0x0F, nibbles >> 4), dim=2)
    return _untile(t).to(torch.int32), _untile_scales(packed[..., 256:288]), _untile_scales(packed[..., 288:320])


def pack_q8(q: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
    """q [N, K] in -127..127, d [N, K / 32] (rounded to fp16) -> uint8 [N / 16, K / 32, 544] (q + 128)."""
    t = _tiles((q.to(torch.int32) + 128).to(torch.uint8))
    return torch.cat((t.reshape(*t.shape[:2], 512), _tile_scales(d)), dim=-1).contiguous()


def unpack_q8(packed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Inverse of `pack_q8`: (q int32 [N, K], d fp32)."""
    t = packed[..., :512].reshape(*packed.shape[:2], 8, TILE_ROWS, 4)
    return _untile(t).to(torch.int32) - 128, _untile_scales(packed[..., 512:544])


def second_plane_blocks(blocks: torch.Tensor, amax: torch.Tensor, crest: float) -> torch.Tensor:
    """bool [M, K / 32]: blocks with an outlier, `max|x| > crest * mean|x|` (never when crest < 0).

    The kernels sum |x| in one sequential fp32 order; so does this (same decisions, same bits)."""
    if crest < 0:
        return torch.zeros_like(amax, dtype=torch.bool)
    sum_abs = torch.zeros_like(amax)
    for j in range(GROUP_SIZE):
        sum_abs = sum_abs + blocks[..., j].abs()
    return amax * float(GROUP_SIZE) > sum_abs * crest


def quantize_activation_blocks(x: torch.Tensor, crest: float = -1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 [M, K] -> (qx int32 [M, K / 32, 32], s fp32 [M, K / 32]) with x ~ s * qx, the kernels' exact
    bits. One plane: qx = q1 in -127..127, s = max|x| / 127. Two planes (`second_plane_blocks`):
    qx = 256 * q1 + q2 with q2 the remainder x / (max|x| / 127) - q1 in 1/256 steps (clamped to
    -127..127), s = max|x| / 127 / 256."""
    blocks = x.float().reshape(x.shape[0], -1, GROUP_SIZE)
    amax = blocks.abs().amax(dim=-1)
    inv = torch.where(amax > 0, 127.0 / amax, torch.zeros_like(amax))
    scaled = blocks * inv[..., None]
    q1 = torch.round(scaled)
    scale = amax / 127.0
    two = second_plane_blocks(blocks, amax, crest)
    q2 = torch.round((scaled - q1) * 256.0).clamp_(-127, 127)
    qx = torch.where(two[..., None], q1 * 256 + q2, q1).to(torch.int32)
    return qx, torch.where(two, scale / 256.0, scale)


def reference_block_a8(
    x: torch.Tensor, weight_q: torch.Tensor, d: torch.Tensor, m: torch.Tensor | None, crest: float = -1.0
) -> torch.Tensor:
    """The op's math in torch (fp64 accumulation): x fp32 [M, K], weight_q int [N, K], d/m [N, K / 32]."""
    qx, sx = quantize_activation_blocks(x, crest)
    n = weight_q.shape[0]
    wq = weight_q.reshape(n, -1, GROUP_SIZE).double()
    dots = torch.einsum("mbk,nbk->mnb", qx.double(), wq)  # exact integers in fp64
    out = (dots * (d.double()[None] * sx.double()[:, None])).sum(-1)
    if m is not None:
        out += (m.double()[None] * (sx.double() * qx.sum(-1).double())[:, None]).sum(-1)
    return out.float()


class BlockA8Linear(nn.Module):
    """y = x @ W.T + bias with W in packed blocks of 32 (`weight_bits` 4 or 8) and per-block int8
    activations, through `torch.ops.voice_server.block_a8_linear`."""

    weight_bits: ClassVar[int]
    in_features: int
    out_features: int
    packed: torch.Tensor
    bias: torch.Tensor | None

    def __init__(self, packed: torch.Tensor, bias: torch.Tensor | None = None, crest: float = DEFAULT_CREST) -> None:
        super().__init__()
        self.crest = float(crest)
        num_tiles, num_blocks, block_bytes = packed.shape
        self.out_features, self.in_features = num_tiles * TILE_ROWS, num_blocks * GROUP_SIZE
        expected = 320 if self.weight_bits == 4 else 544
        if packed.dtype != torch.uint8 or block_bytes != expected:
            raise ValueError(
                f"packed must be uint8 [N / 16, K / 32, {expected}], got {packed.dtype} {tuple(packed.shape)}"
            )
        self.register_buffer("packed", packed.contiguous())
        self.register_buffer("bias", None if bias is None else bias.detach().float().contiguous())

    def unpacked(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """(q int32 [N, K], d fp32 [N, K / 32], m fp32 or None)."""
        raise NotImplementedError

    def dequantize(self) -> torch.Tensor:
        """The fp32 weight [N, K] the blocks hold."""
        q, d, m = self.unpacked()
        w = q.float().reshape(self.out_features, -1, GROUP_SIZE) * d[..., None]
        if m is not None:
            w = w + m[..., None]
        return w.reshape(self.out_features, self.in_features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        rows = x.reshape(-1, self.in_features)
        if rows.dtype != torch.float32 or not rows.is_contiguous():
            rows = rows.float().contiguous()
        if kernels.available():
            out = torch.ops.voice_server.block_a8_linear(
                rows, self.packed, self.weight_bits, self.bias, self.crest
            )
        else:
            q, d, m = self.unpacked()
            out = reference_block_a8(rows, q, d, m, self.crest)
            if self.bias is not None:
                out = out + self.bias
        return out.to(x.dtype).view(*shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


class W4A8Linear(BlockA8Linear):
    """GGUF Q4_1 weights (`d * q + m` per 32) x int8 activations per 32."""

    weight_bits = 4

    @classmethod
    def from_blocks(
        cls, q: torch.Tensor, d: torch.Tensor, m: torch.Tensor, bias: torch.Tensor | None = None
    ) -> W4A8Linear:
        check_block_shape(*q.shape)
        return cls(pack_q4(q, d, m), bias)

    @classmethod
    def from_q4_1(cls, raw: object, bias: torch.Tensor | None = None) -> W4A8Linear:
        """GGUF Q4_1 rows [N, K // 32 * 20], exactly (d and m are the file's fp16)."""
        return cls.from_blocks(*q4_1_unpack(raw), bias)

    @classmethod
    def from_float(cls, weight: torch.Tensor, bias: torch.Tensor | None = None) -> W4A8Linear:
        """Q4_1 of a float weight: per 32, d = (max - min) / 15 and m = min (fp16), q chosen against them."""
        n, k = weight.shape
        check_block_shape(n, k)
        w = weight.detach().float().reshape(n, k // GROUP_SIZE, GROUP_SIZE)
        lo, hi = w.amin(dim=-1), w.amax(dim=-1)
        d = ((hi - lo) / 15.0).to(torch.float16).float()
        m = lo.to(torch.float16).float()
        safe = torch.where(d > 0, d, torch.ones_like(d))
        q = torch.round((w - m[..., None]) / safe[..., None]).clamp(0, 15).to(torch.int32)
        return cls.from_blocks(q.reshape(n, k), d, m, bias)

    def unpacked(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        return unpack_q4(self.packed)


class Q8A8Linear(BlockA8Linear):
    """GGUF Q8_0 weights (`d * q` per 32) x int8 activations per 32 (the lm_head of `w4a8`)."""

    weight_bits = 8

    @classmethod
    def from_blocks(cls, q: torch.Tensor, d: torch.Tensor, bias: torch.Tensor | None = None) -> Q8A8Linear:
        check_block_shape(*q.shape)
        return cls(pack_q8(q, d), bias)

    @classmethod
    def from_q8_0(cls, raw: object, bias: torch.Tensor | None = None) -> Q8A8Linear:
        """GGUF Q8_0 rows [N, K // 32 * 34], exactly."""
        return cls.from_blocks(*q8_0_unpack(raw), bias)

    @classmethod
    def from_float(cls, weight: torch.Tensor, bias: torch.Tensor | None = None) -> Q8A8Linear:
        """Q8_0 of a float weight: per 32, d = max|w| / 127 (fp16), q chosen against it."""
        n, k = weight.shape
        check_block_shape(n, k)
        w = weight.detach().float().reshape(n, k // GROUP_SIZE, GROUP_SIZE)
        d = (w.abs().amax(dim=-1) / 127.0).to(torch.float16).float()
        safe = torch.where(d > 0, d, torch.ones_like(d))
        q = torch.round(w / safe[..., None]).clamp(-127, 127).to(torch.int32)
        return cls.from_blocks(q.reshape(n, k), d, bias)

    def unpacked(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        q, d = unpack_q8(self.packed)
        return q, d, None


def fuse_block_linears(parts: list[BlockA8Linear], bias: torch.Tensor | None) -> BlockA8Linear:
    """Outputs concatenated: tiles of 16 channels are independent, so the packed tensors stack."""
    cls = type(parts[0])
    return cls(torch.cat([p.packed for p in parts]), bias)


__all__ = [
    "BlockA8Linear",
    "Q8A8Linear",
    "TILE_ROWS",
    "W4A8Linear",
    "check_block_shape",
    "fuse_block_linears",
    "pack_q4",
    "pack_q8",
    "quantize_activation_blocks",
    "reference_block_a8",
    "unpack_q4",
    "unpack_q8",
]
