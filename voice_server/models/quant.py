"""Quantising a model: each `nn.Linear` in a mode, the lm_head and a tied embedding, q/k/v and gate/up fused.

The modules it picks from:
- `Int8Linear` / `Int4Linear` / `QuantEmbedding` (`quant_weight_only.py`): weight-only, torch's own CPU
  kernels, bf16 activations.
- `W8A8Linear` (`quant_w8a8.py`): int8 weights per channel and int8 activations per row through
  `torch._int_mm`; exactly batch invariant.
- `W4A8Linear` / `Q8A8Linear` (`quant_w4a8.py`): GGUF Q4_1 / Q8_0 blocks as they are times int8
  activations per 32 (llama.cpp's math) through our C++ op (`voice_server/kernels`); exactly batch
  invariant. Mode `w4a8` (Q8A8 lm_head); without the kernels it falls back to `int4`.
The modes and the per-CPU defaults live in `quant_policy.py`; callers import all of it from here (`__all__`).

`fuse_projections` concatenates q/k/v into `qkv_proj` and gate/up into `gate_up_proj` (output rows
stacked; float or quantised); `Attention`/`SwiGLU` use the fused module when it is there.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from voice_server.models.gguf_blocks import GROUP_SIZE, q4_1_unpack, q8_0_unpack
from voice_server.models.quant_policy import (
    QUANT_MODES,
    check_mode,
    cpu_flags,
    default_dtype,
    default_lm_head_mode,
    default_quantization,
    effective_mode,
    has_native_bf16,
)
from voice_server.models.quant_w4a8 import BlockA8Linear, Q8A8Linear, W4A8Linear, fuse_block_linears
from voice_server.models.quant_w8a8 import W8A8Linear
from voice_server.models.quant_weight_only import Int4Linear, Int8Linear, QuantEmbedding, quantize_int4_groups

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


def quantize_head(linear: nn.Module, mode: str) -> nn.Module:
    """lm_head in `mode`: as `quantize_linear`, except `w4a8` is Q8_0 blocks (`Q8A8Linear`), not 4-bit."""
    if mode == "w4a8" and isinstance(linear, nn.Linear) and not linear.in_features % GROUP_SIZE \
            and not linear.out_features % 16:
        return Q8A8Linear.from_float(linear.weight.detach(), linear.bias)
    return quantize_linear(linear, mode)


def _set_submodule(root: nn.Module, name: str, module: nn.Module) -> None:
    parent_name, _, attr = name.rpartition(".")
    setattr(root.get_submodule(parent_name) if parent_name else root, attr, module)


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
    "check_mode",
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
