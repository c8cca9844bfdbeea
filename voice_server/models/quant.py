"""Quantised linears for CPU decode (torch's own int8/int4/int8xint8 kernels), fusion, policy.

- `Int8Linear`: int8 weights with one scale per output channel, bf16 activations through
  `aten._weight_int8pack_mm` (the input is cast to bf16, the output back to the caller's dtype).
- `Int4Linear`: 4-bit weights in groups of 32 along the input axis, `weight = (q - 8) * scale + zero`
  with q in 0..15, through `aten._weight_int4pack_mm_for_cpu` (bf16 activations, same casts).
- `QuantEmbedding`: an int8 lookup table with one scale per 32 values of a row (exactly GGUF Q8_0),
  dequantising only the looked-up rows; it stands in for a tied embedding once `lm_head` is quantised.
- `W8A8Linear` (`quant_w8a8.py`): int8 weights per channel and int8 activations per row through
  `torch._int_mm`; exactly batch invariant.
- `W4A8Linear` / `Q8A8Linear` (`quant_w4a8.py`): GGUF Q4_1 / Q8_0 blocks as they are times int8
  activations per 32 (llama.cpp's math) through our C++ op (`voice_server/kernels`); exactly batch
  invariant. Mode `w4a8` (Q8A8 lm_head); without the kernels it falls back to `int4`.

GGUF blocks that map exactly are used as is: Q4_1 (`d * q + m` per 32) is `Int4Linear` with
`scale = d`, `zero = m + 8 * d` (only the bf16 rounding of d and m changes anything); Q8_0 is
`QuantEmbedding` unchanged. Q8_0 -> `Int8Linear` has to requantise (per 32 -> per row): the block
values `d * q` are rebuilt in fp32 and quantised symmetrically per row (`scale = max|w| / 127`),
so each weight moves by at most half a row step on top of Q8_0's own error.

`fuse_projections` concatenates q/k/v into `qkv_proj` and gate/up into `gate_up_proj` (output rows
stacked; float or quantised); `Attention`/`SwiGLU` use the fused module when it is there.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from pathlib import Path

import torch
from torch import nn

from voice_server import kernels
from voice_server.models.gguf_blocks import GROUP_SIZE, q4_1_unpack, q8_0_unpack
from voice_server.models.quant_w4a8 import BlockA8Linear, Q8A8Linear, W4A8Linear, fuse_block_linears
from voice_server.models.quant_w8a8 import PerChannelInt8Linear, W8A8Linear

QUANT_MODES = ("none", "int8", "int4", "w8a8", "w4a8")


# ---------------------------------------------------------------------------------------------
# CPU policy
# ---------------------------------------------------------------------------------------------


@functools.lru_cache(maxsize=1)
def cpu_flags() -> frozenset[str]:
    """The `flags` of the first CPU in /proc/cpuinfo (empty where there is none, e.g. macOS)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return frozenset()
    for line in text.splitlines():
        if line.startswith("flags"):
            return frozenset(line.partition(":")[2].split())
    return frozenset()


def has_native_bf16() -> bool:
    """True where bf16 dot products run in hardware (AVX512-BF16 or AMX) and torch's kernels are
    dispatched at that level (`ATEN_CPU_CAPABILITY=avx2` makes them AVX2 even on such a CPU)."""
    capability = torch.backends.cpu.get_cpu_capability()
    return capability.startswith("AVX512") and bool(cpu_flags() & {"avx512_bf16", "amx_bf16"})


def default_quantization() -> str:
    """`w4a8` on every x86 CPU with AVX2 or better (`int4` where our C++ kernels cannot be built:
    `effective_mode`), else `none`.

    NOTE: `w4a8` (the Q4_1 blocks as they are, int8 activations per 32 with a second plane for
    outlier blocks, our C++ op) against `int4` (torch's kernel, bf16 activations), SmolLM2 through
    the runner, 1 thread, same process, EPYC with AVX512-VNNI: decode 95 vs 86 tok/s, 8 streams
    359 vs 300 tok/s, TTFT of 206 tokens 223 vs 340 ms; greedy agreement with fp32 1.0 vs 0.89 (3
    prompts) and 0.865 vs 0.78 (12 prompts). With torch's kernels at AVX2
    (`ATEN_CPU_CAPABILITY=avx2`) and our AVX2 path, all linears of a step: 5.0 vs 13.0 ms at 1 row,
    16.1 vs 26.4 ms at 8 rows. A real AVX2-only CPU was not measured.

    NOTE: decode is bound by reading weights, and both weight-only kernels read bf16 activations
    but convert them to fp32 in registers (a shift), so they do not need native bf16: int4 reads
    half the bytes of int8 and was fastest both natively and with `ATEN_CPU_CAPABILITY=avx2` on
    the same AVX512-BF16 EPYC (SmolLM2 decode step, 1 thread, ms: AVX512 int4 11.9 / int8 14.9 /
    fp32 37.6; AVX2 kernels int4 18.6 / int8 19.6 / fp32 38.0). A real AVX2-only CPU was not
    measured. Without AVX2 (ARM, old x86) stay on fp32: the kernels' vector paths are x86.

    NOTE: `w8a8` (int8 activations per row, `torch._int_mm`) is not the default even with
    AVX512-VNNI: on SmolLM2 its greedy agreement with fp32 is 0.54 (int4 0.86) with a first-token
    flip, from the RMSNorm-fed inputs (W8A8 on qkv alone: 0.47, gate_up alone: 0.42, o_proj 0.84,
    lm_head 0.89; outlier channels, no smoothing yet). Speed through the runner, 1 thread, same
    EPYC (AVX512-VNNI), two runs: TTFT of 206 tokens 135-141 ms vs 318-320 ms (prefill is
    compute-bound), but single-stream decode 76-78 vs 87 tok/s (int8 weights are twice int4's
    bytes and decode is bandwidth-bound once weights leave the cache), 4 streams 152-159 vs 228-229
    tok/s, 8 streams 256-257 vs 270-277 tok/s (`_int_mm`'s M>=2 GEMM is slow on cold weights).
    """
    flags = cpu_flags()
    if "avx2" in flags or "avx512f" in flags:
        return "w4a8"
    return "none"


def default_dtype() -> torch.dtype:
    """Dtype of the residual stream (norms, rope, attention) next to the quantised linears.

    fp32 everywhere: the quantised kernels take bf16 anyway, the step's non-linear work is small,
    and fp32 keeps the greedy ids closest to the fp32 model (bf16 residuals measured no faster).
    """
    return torch.float32


# ---------------------------------------------------------------------------------------------
# Quantisation arithmetic
# ---------------------------------------------------------------------------------------------


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


# ---------------------------------------------------------------------------------------------
# Modules
# ---------------------------------------------------------------------------------------------


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


QuantLinear = Int8Linear | Int4Linear | W8A8Linear | BlockA8Linear
AnyLinear = nn.Linear | Int8Linear | Int4Linear | W8A8Linear | BlockA8Linear


# ---------------------------------------------------------------------------------------------
# Fusion
# ---------------------------------------------------------------------------------------------


LINEAR_TYPES = (nn.Linear, Int8Linear, Int4Linear, W8A8Linear, BlockA8Linear)
"""Every module kind a projection may be (float, weight-only quantised or W8A8)."""


def _concat_bias(parts: Sequence[AnyLinear]) -> torch.Tensor | None:
    biases = [getattr(p, "bias", None) for p in parts]
    if all(b is None for b in biases):
        return None
    return torch.cat(
        [b.detach().float() if b is not None else torch.zeros(p.out_features) for p, b in zip(parts, biases)]
    )


def fuse_linears(parts: Sequence[AnyLinear]) -> nn.Module:
    """One linear whose output is the concatenation of `parts`' outputs (same input, same kind)."""
    first = parts[0]
    if any(type(p) is not type(first) or p.in_features != first.in_features for p in parts):
        raise ValueError("fuse_linears needs linears of one kind and one in_features")
    bias = _concat_bias(parts)
    if isinstance(first, nn.Linear):
        weight = torch.cat([p.weight.detach() for p in parts if isinstance(p, nn.Linear)])
        fused = nn.Linear(first.in_features, weight.shape[0], bias=bias is not None, device=weight.device)
        fused.weight = nn.Parameter(weight, requires_grad=False)
        if bias is not None:
            fused.bias = nn.Parameter(bias.to(weight.dtype), requires_grad=False)
        return fused
    if isinstance(first, Int8Linear):
        int8_parts = [p for p in parts if isinstance(p, Int8Linear)]
        return Int8Linear(
            torch.cat([p.qweight for p in int8_parts]), torch.cat([p.scales for p in int8_parts]), bias
        )
    if isinstance(first, W8A8Linear):
        w8a8_parts = [p for p in parts if isinstance(p, W8A8Linear)]
        return W8A8Linear(
            torch.cat([p.qweight for p in w8a8_parts]), torch.cat([p.scales for p in w8a8_parts]), bias
        )
    if isinstance(first, BlockA8Linear):
        return fuse_block_linears([p for p in parts if isinstance(p, BlockA8Linear)], bias)
    if isinstance(first, Int4Linear):
        int4_parts = [p for p in parts if isinstance(p, Int4Linear)]
        if any(p.group_size != first.group_size for p in int4_parts):
            raise ValueError("fuse_linears needs one group_size")
        unpacked = [p.unpack() for p in int4_parts]
        q, scales, zeros = (torch.cat([u[i] for u in unpacked]) for i in range(3))
        return Int4Linear(q, scales, zeros, bias, first.group_size)
    raise TypeError(f"cannot fuse {type(first).__name__}")


def fuse_projections(model: nn.Module) -> int:
    """Replace q/k/v by `qkv_proj` in every `Attention` and gate/up by `gate_up_proj` in every
    `SwiGLU` (output rows concatenated in that order); returns how many modules were fused."""
    from voice_server.models.layers import Attention, SwiGLU

    count = 0
    for module in list(model.modules()):
        if isinstance(module, Attention) and module.qkv_proj is None:
            parts = [module.q_proj, module.k_proj, module.v_proj]
            module.qkv_proj = fuse_linears(parts)
            module.qkv_sizes = tuple(int(p.out_features) for p in parts)
            del module.q_proj, module.k_proj, module.v_proj
            count += 1
        elif isinstance(module, SwiGLU) and module.gate_up_proj is None:
            module.gate_up_proj = fuse_linears([module.gate_proj, module.up_proj])
            del module.gate_proj, module.up_proj
            count += 1
    return count


# ---------------------------------------------------------------------------------------------
# Whole-model quantisation
# ---------------------------------------------------------------------------------------------


def quantize_linear(linear: nn.Module, mode: str) -> nn.Module:
    """`linear` (nn.Linear or already quantised) in `mode`; unchanged where the shape does not fit."""
    if mode == "none" or not isinstance(linear, nn.Linear):
        return linear
    weight, bias = linear.weight.detach(), linear.bias
    if mode == "int8":
        return Int8Linear.from_float(weight, bias)
    if mode == "w8a8":
        return W8A8Linear.from_float(weight, bias)
    if mode in ("int4", "w4a8"):
        if linear.in_features % GROUP_SIZE or linear.out_features % 16:
            return Int8Linear.from_float(weight, bias)
        return (W4A8Linear if mode == "w4a8" else Int4Linear).from_float(weight, bias)
    raise ValueError(f"mode must be one of {QUANT_MODES}, got {mode!r}")


def default_lm_head_mode(mode: str) -> str:
    """int8 for any quantised model: lm_head is the one matrix whose error goes straight into the
    logits, and int4 (min/max per 32) of SmolLM2's tied embedding flipped the very first greedy
    token (logit error ~2 on random inputs against ~0.3 for int8); llama.cpp keeps it Q8_0 too."""
    if mode in ("w8a8", "w4a8"):
        return mode
    return "none" if mode == "none" else "int8"


def quantize_head(linear: nn.Module, mode: str) -> nn.Module:
    """lm_head in `mode`: as `quantize_linear`, except `w4a8` is Q8_0 blocks (`Q8A8Linear`), not 4-bit."""
    if mode == "w4a8" and isinstance(linear, nn.Linear) and not linear.in_features % GROUP_SIZE \
            and not linear.out_features % 16:
        return Q8A8Linear.from_float(linear.weight.detach(), linear.bias)
    return quantize_linear(linear, mode)


def effective_mode(mode: str) -> str:
    """`mode` as it will run: `w4a8` needs the C++ kernels and is `int4` without them (no compiler,
    `VOICE_SERVER_NO_KERNELS=1`; `kernels.available()` logs why once)."""
    if mode == "w4a8" and not kernels.available():
        return "int4"
    return mode


def _set_submodule(root: nn.Module, name: str, module: nn.Module) -> None:
    parent_name, _, attr = name.rpartition(".")
    setattr(root.get_submodule(parent_name) if parent_name else root, attr, module)


def check_mode(mode: str) -> str:
    if mode not in QUANT_MODES:
        raise ValueError(f"quantization must be one of {QUANT_MODES}, got {mode!r}")
    return mode


@torch.no_grad()
def quantize_model(
    model: nn.Module,
    mode: str,
    *,
    lm_head_mode: str | None = None,
    dtype: torch.dtype | None = None,
    fuse: bool = True,
) -> nn.Module:
    """Quantise every `nn.Linear` of `model` in place (`QUANT_MODES`) and return it.

    `lm_head` (when the model has one) gets `lm_head_mode` (default: `default_lm_head_mode`). A tied input
    embedding is replaced by a `QuantEmbedding` (int8 per 32, ~1/4 of fp32) so lookups still work
    once `lm_head` no longer holds a float matrix. `dtype` (default: the float dtype the model has)
    is the residual-stream dtype: the remaining float parameters are cast to it. With `fuse`,
    q/k/v and gate/up are fused first (fewer, larger matmuls).
    """
    mode = effective_mode(check_mode(mode))
    head_mode = effective_mode(check_mode(lm_head_mode or default_lm_head_mode(mode)))
    float_params = [p for p in model.parameters() if p.is_floating_point()]
    act_dtype = dtype or (float_params[0].dtype if float_params else torch.float32)
    if fuse:
        fuse_projections(model)
    lm_head = getattr(model, "lm_head", None)
    embed = getattr(getattr(model, "model", None), "embed_tokens", None)
    if isinstance(lm_head, nn.Linear) and head_mode != "none":
        if isinstance(embed, nn.Embedding) and embed.weight is lm_head.weight:
            model.model.embed_tokens = QuantEmbedding.from_float(embed.weight, act_dtype)  # type: ignore[union-attr]
        model.lm_head = quantize_head(lm_head, head_mode)
    if mode != "none":
        for name, module in list(model.named_modules()):
            if isinstance(module, nn.Linear) and name != "lm_head":
                _set_submodule(model, name, quantize_linear(module, mode))
    # NOTE: parameters only: `model.to(dtype)` would also cast the kernels' bf16 scale buffers.
    for param in model.parameters():
        if param.is_floating_point():
            param.data = param.data.to(act_dtype)
    for module in model.modules():
        if isinstance(module, QuantEmbedding):
            module.dtype = act_dtype
    return model


__all__ = [
    "GROUP_SIZE",
    "QUANT_MODES",
    "BlockA8Linear",
    "Int4Linear",
    "Int8Linear",
    "Q8A8Linear",
    "QuantEmbedding",
    "W4A8Linear",
    "W8A8Linear",
    "cpu_flags",
    "default_dtype",
    "default_quantization",
    "effective_mode",
    "fuse_linears",
    "default_lm_head_mode",
    "fuse_projections",
    "has_native_bf16",
    "quantize_int4_groups",
    "quantize_head",
    "quantize_model",
    "quantize_linear",
    "q4_1_unpack",
    "q8_0_unpack",
]
