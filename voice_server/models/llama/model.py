"""Dense decoder (Llama / SmolLM2 / Qwen2 / Qwen3-dense) with transformers' parameter names.

The model runs one forward per call on explicit positions and an explicit `KVCache`; generation
loops live elsewhere (`generate.py` for tests and benchmarks, the runner in the server).
"""

from __future__ import annotations

import math
from typing import cast

import torch
import torch.nn.functional as F
from torch import nn

from voice_server.models.layers import (
    Attention,
    DecoderLayer,
    KVCache,
    RMSNorm,
    SwiGLU,
    rope_angles,
    rope_cos_sin,
    rope_inv_freq,
    signed_sin,
)
from voice_server.models.llama.config import LlamaConfig
from voice_server.models.llama.fused import FusedLayers
from voice_server.models.paged import AttentionContext
from voice_server.models.shapes import expect_shapes


def llama_inv_freq(cfg: LlamaConfig) -> torch.Tensor:
    """Inverse RoPE frequencies [head_dim // 2], fp32, with Llama 3 scaling when configured."""
    inv_freq = rope_inv_freq(cfg.head_dim, cfg.rope_theta)
    if cfg.rope_type != "llama3":
        return inv_freq
    # NOTE: same arithmetic as transformers' `_compute_llama3_parameters`, so positions round alike.
    factor, low, high = cfg.rope_factor, cfg.rope_low_freq_factor, cfg.rope_high_freq_factor
    old_len = cfg.rope_original_max_position_embeddings
    low_freq_wavelen, high_freq_wavelen = old_len / low, old_len / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def create_decoder_layer(cfg: LlamaConfig, layer_idx: int) -> DecoderLayer:
    attn = Attention(
        cfg.hidden_size,
        cfg.num_attention_heads,
        cfg.num_key_value_heads,
        cfg.head_dim,
        qkv_bias=cfg.attention_bias,
        o_bias=cfg.attention_out_bias,
        qk_norm=cfg.qk_norm,
        norm_eps=cfg.rms_norm_eps,
        sliding_window=cfg.layer_sliding_window(layer_idx),
    )
    mlp = SwiGLU(cfg.hidden_size, cfg.intermediate_size, bias=cfg.mlp_bias)
    return DecoderLayer(attn, mlp, cfg.hidden_size, cfg.rms_norm_eps)


class LlamaModel(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        weight = torch.empty(cfg.vocab_size, cfg.hidden_size)
        # NOTE: built on the meta device (by the loaders), nn.Embedding's normal_ init imports
        # torch._dynamo, 1-2 s of every start-up; a meta weight needs no init anyway.
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size, _weight=weight) if weight.is_meta \
            else nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(create_decoder_layer(cfg, i) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class LlamaForCausalLM(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.config = cfg
        self.model = LlamaModel(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.tie_weights()
        # NOTE: not a buffer: the model may be built on the meta device and materialised by the
        # loader, and a buffer would then hold garbage; this is recomputed per device on demand.
        self._inv_freq: dict[torch.device, torch.Tensor] = {}
        self._signed_rope_tables: dict[tuple[torch.device, torch.dtype], tuple[torch.Tensor, torch.Tensor]] = {}
        self.is_fused = True
        self._fused: FusedLayers | bool | None = None  # None: not tried yet; False: not supported

    def tie_weights(self) -> None:
        self.lm_head.weight = self.model.embed_tokens.weight

    @torch.no_grad()
    def use_column_major_weights(self) -> None:
        """Store every fp32 matrix transposed in memory (same [out, in] shape and names, new strides).

        NOTE: single-token decode is bound by reading the weights; with one thread MKL's fp32 GEMV
        streams an [in, out]-contiguous matrix faster (SmolLM2-135M, AVX2 EPYC: 112-116 -> 88-103 ms
        per token, identical logits). bf16 is the other way round (about 5x slower): fp32 only. The
        parameters become non-contiguous views: call `.contiguous()` before saving them.
        """
        if any(p.dtype != torch.float32 for p in self.parameters()):
            raise ValueError("use_column_major_weights needs an fp32 model")
        for module in self.modules():
            if isinstance(module, nn.Linear | nn.Embedding):
                module.weight = nn.Parameter(module.weight.t().contiguous().t(), requires_grad=False)
        if self.config.tie_word_embeddings:
            self.tie_weights()

    def fused_layers(self) -> FusedLayers | None:
        """The layers as one C++ call per paged step, where this model's parts allow it (built on
        first use; `is_fused = False` turns it off)."""
        if not self.is_fused:
            return None
        if self._fused is None:
            self._fused = FusedLayers.of(self) or False
        return self._fused if isinstance(self._fused, FusedLayers) else None

    def make_kv_cache(self) -> KVCache:
        return KVCache(self.config.num_hidden_layers)

    def rope_cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        device = positions.device
        inv_freq = self._inv_freq.get(device)
        if inv_freq is None:
            inv_freq = self._inv_freq[device] = llama_inv_freq(self.config).to(device)
        return rope_cos_sin(rope_angles(positions, inv_freq), dtype)

    def signed_rope_table(self, device: torch.device, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and `signed_sin` [max_position_embeddings, head_dim] for every position (for
        `apply_rotary_signed`), computed once per device and dtype.

        NOTE: the paged path indexes this table rather than computing cos/sin per step: cheaper, and
        a row's values then cannot depend on how many rows the step has (vectorised vs scalar tails).
        """
        key = (device, dtype)
        table = self._signed_rope_tables.get(key)
        if table is None:
            cos, sin = self.rope_cos_sin(torch.arange(self.config.max_position_embeddings, device=device), dtype)
            table = self._signed_rope_tables[key] = (cos, signed_sin(sin))
        return table

    def forward_paged(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        ctx: AttentionContext,
        logits_indices: torch.Tensor,
    ) -> torch.Tensor:
        """Flat input_ids/positions [T] of a ragged batch -> logits [S, V] of rows `logits_indices` [S].

        Only the rows that are sampled go through the final norm and lm_head.
        """
        x = self.model.embed_tokens(input_ids)
        cos_table, sin_table = self.signed_rope_table(x.device, x.dtype)
        fused = self.fused_layers() if ctx.cache.use_decode_kernel else None
        if fused is not None:
            fused.run(x, cos_table[positions], sin_table[positions], ctx)
            return self.lm_head(self.model.norm(x.index_select(0, logits_indices)))
        x = x[None]
        # NOTE: [1, 1, T, D], broadcast over heads by every layer's `apply_rotary_signed`.
        cos, sin = cos_table[positions][None, None], sin_table[positions][None, None]
        for i, layer in enumerate(self.model.layers):
            x = layer(x, cos, sin, ctx, i)
        hidden = x[0].index_select(0, logits_indices)
        return self.lm_head(self.model.norm(hidden))

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_cache: KVCache | None = None,
        *,
        extra_mask: torch.Tensor | None = None,
        is_last_only: bool = False,
    ) -> torch.Tensor:
        """input_ids/positions [B, L] -> logits [B, L, V] ([B, 1, V] with `is_last_only`).

        The cache must hold exactly the tokens before these (positions are not checked against it);
        `extra_mask` (bool [B, 1, L, Lk], True = attend) is ANDed with the causal mask.
        """
        expect_shapes(("input_ids", input_ids, "[B, L]", torch.long), ("positions", positions, "[B, L]", torch.long))
        x = self.model.embed_tokens(input_ids)
        cos, sin = self.rope_cos_sin(positions, x.dtype)
        for i, layer in enumerate(self.model.layers):
            x = layer(x, cos, sin, kv_cache, i, extra_mask)
        if is_last_only:
            x = x[:, -1:]
        return self.lm_head(self.model.norm(x))



class PagedDecodeGraph(nn.Module):
    """`forward_paged` for one decode row of one sequence, as a module to export whole (attention
    included) for `voice_server.runners.compiled.CompiledDecodeStep`.

    The keys are the sequence's pages gathered whole (`page_index` [P], P dynamic), this step's key
    appended last, and a mask for the gathered slots at or past `kv_len - 1` (page tail, and this
    step's own slot, not written yet). The cache is only read: the step's keys/values come back as
    `new_kv` [num_layers, 2, H_kv, D] for the caller to write (one `index_copy_`).
    """

    model: LlamaForCausalLM
    cos_table: torch.Tensor
    sin_table: torch.Tensor

    def __init__(self, model: LlamaForCausalLM, page_size: int) -> None:
        super().__init__()
        self.model, self.page_size = model, page_size
        norm_weight = model.model.norm.weight
        cos, sin = model.signed_rope_table(norm_weight.device, norm_weight.dtype)
        self.register_buffer("cos_table", cos, persistent=False)
        self.register_buffer("sin_table", sin, persistent=False)

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, page_index: torch.Tensor, kv_len: torch.Tensor,
        kv: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """input_ids/positions [1], page_index [P], kv_len [] (long), kv the `PagedKVCache.kv` ->
        (final-normed hidden [1, hidden], new_kv [num_layers, 2, H_kv, D])."""
        inner = self.model.model
        x = inner.embed_tokens(input_ids)[None]
        cos, sin = self.cos_table[positions][None, None], self.sin_table[positions][None, None]
        num_slots = page_index.shape[0] * self.page_size
        j = torch.arange(num_slots + 1, device=page_index.device)
        mask = ((j < kv_len - 1) | (j == num_slots))[None, None, None]
        heads_kv, head_dim = kv.shape[-2], kv.shape[-1]
        new_kv = []
        for i, module in enumerate(inner.layers):
            layer = cast(DecoderLayer, module)
            q, k, v = layer.self_attn.project(layer.input_layernorm(x), cos, sin, True)
            past_k = kv[i, 0].index_select(0, page_index).reshape(1, num_slots, heads_kv, head_dim).transpose(1, 2)
            past_v = kv[i, 1].index_select(0, page_index).reshape(1, num_slots, heads_kv, head_dim).transpose(1, 2)
            keys, values = torch.cat((past_k, k), dim=2), torch.cat((past_v, v), dim=2)
            out = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, enable_gqa=True)
            x = layer.finish(x, out)
            new_kv.append(torch.stack((k[0, :, 0], v[0, :, 0])))
        return inner.norm(x[0]), torch.stack(new_kv)
