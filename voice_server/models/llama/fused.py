"""`FusedLayers`: every layer of a w4a8 dense decoder as one C++ call per step.

`torch.ops.voice_server.decoder_stack_run` (`voice_server/kernels/decoder_stack.cpp`) runs the
layers' norms, block-quantised projections, RoPE, cache writes, paged attention, SiLU and residuals
without returning to Python: on SmolLM2-135M the Python layers spent 3-4 ms of a 9 ms single-row
step in op dispatch. The numbers differ from the Python layers only by rounding (its exp and norm
sums are its own), and every row is computed on its own: batch invariant like the Python path.

It serves a model whose projections are all `BlockA8Linear` with q/k/v and gate/up fused, without
q/k norms or sliding windows, on an fp32 paged cache whose decode kernel runs (`PagedKVCache.
use_decode_kernel`); `FusedLayers.of` says None for any other model, and the Python layers run.
"""

from __future__ import annotations

import weakref
from typing import TYPE_CHECKING, cast

import torch

from voice_server import kernels
from voice_server.models.layers import DecoderLayer, SwiGLU
from voice_server.models.quant_w4a8 import BlockA8Linear

if TYPE_CHECKING:
    from voice_server.models.llama.model import LlamaForCausalLM
    from voice_server.models.paged import AttentionContext


_PARTS = ("input_norm", "qkv", "qkv_bias", "o", "o_bias", "post_norm", "gate_up", "gate_up_bias", "down",
          "down_bias")
"""The weight lists of `decoder_stack_create`, in its argument order."""


def _no_bias() -> torch.Tensor:
    return torch.empty(0)


def _bias(module: BlockA8Linear) -> torch.Tensor:
    return module.bias if module.bias is not None else _no_bias()


class FusedLayers:
    """A registered C++ decoder stack over a model's weights (freed with this object)."""

    def __init__(self, handle: int, num_layers: int) -> None:
        self.handle, self.num_layers = handle, num_layers
        weakref.finalize(self, torch.ops.voice_server.decoder_stack_free, handle)

    @classmethod
    def of(cls, model: LlamaForCausalLM) -> FusedLayers | None:
        """The stack for `model`, or None when it has a part the C++ layers do not run."""
        cfg = model.config
        if not kernels.available() or cfg.qk_norm or model.model.norm.weight.dtype != torch.float32:
            return None
        layers = [cast(DecoderLayer, layer) for layer in model.model.layers]
        parts: dict[str, list[torch.Tensor]] = {name: [] for name in _PARTS}
        crests: set[float] = set()
        for layer in layers:
            attn, mlp = layer.self_attn, layer.mlp
            if not isinstance(mlp, SwiGLU) or attn.sliding_window is not None:
                return None
            linears = (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)
            if not all(isinstance(m, BlockA8Linear) for m in linears):
                return None
            qkv, o, gate_up, down = cast(tuple[BlockA8Linear, ...], linears)
            crests.update(m.crest for m in (qkv, o, gate_up, down))
            for name, tensor in (
                ("input_norm", layer.input_layernorm.weight), ("post_norm", layer.post_attention_layernorm.weight),
                ("qkv", qkv.packed), ("qkv_bias", _bias(qkv)), ("o", o.packed), ("o_bias", _bias(o)),
                ("gate_up", gate_up.packed), ("gate_up_bias", _bias(gate_up)), ("down", down.packed),
                ("down_bias", _bias(down)),
            ):
                parts[name].append(tensor.detach())
        if len(crests) != 1:
            return None
        handle = torch.ops.voice_server.decoder_stack_create(
            *parts.values(), cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, cfg.rms_norm_eps,
            crests.pop(),
        )
        return cls(int(handle), len(layers))

    def run(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, ctx: AttentionContext) -> None:
        """x [rows, hidden] fp32 in place through every layer; cos/sin [rows, D] (sin signed)."""
        torch.ops.voice_server.decoder_stack_run(
            self.handle, x, ctx.cache.kv, ctx.slot_mapping, cos, sin, ctx.page_index, ctx.row_seqs
        )


__all__ = ["FusedLayers"]
