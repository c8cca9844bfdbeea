"""Building blocks shared by every decoder in `voice_server.models`.

Models take an explicit `KVCache` argument and never loop over generation steps themselves:
a runner drives them one step at a time. The server's runner passes a paged
`voice_server.models.paged.AttentionContext` in the cache's place instead.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

if TYPE_CHECKING:
    from voice_server.models.paged import PagedAttention


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # NOTE: normalise in fp32 and scale after casting back, as the HF Qwen/Llama norms do;
        # the order matters for bf16 parity.
        dtype = x.dtype
        if dtype == torch.float32 and self.weight.dtype == torch.float32:
            # One call instead of seven (the step's norms are ~60 tiny ops); bit-identical in fp32.
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(dtype)


class SwiGLU(nn.Module):
    """Gated MLP (`down(silu(gate(x)) * up(x))`), the dense FFN of Llama/Qwen."""

    def __init__(self, hidden_size: int, intermediate_size: int, bias: bool = False) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=bias)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=bias)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=bias)
        # Set by `quant.fuse_projections`: gate and up as one matmul (rows concatenated).
        self.gate_up_proj: nn.Module | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gate_up_proj is not None:
            gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
            return self.down_proj(F.silu(gate) * up)
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


# ---------------------------------------------------------------------------------------------
# Rotary position embeddings
# ---------------------------------------------------------------------------------------------


def rope_inv_freq(head_dim: int, theta: float) -> torch.Tensor:
    """Inverse frequencies of the default (non-scaled) RoPE, fp32, shape [head_dim // 2]."""
    return 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))


def rope_cos_sin(freqs: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin tables [..., head_dim] from angles `freqs` [..., head_dim // 2] (HF half-split layout)."""
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def rope_angles(positions: torch.Tensor, inv_freq: torch.Tensor) -> torch.Tensor:
    """Angles [B, L, head_dim // 2] for integer positions [B, L]; computed in fp32."""
    return positions.to(torch.float32)[..., None] * inv_freq.to(positions.device)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x [B, H, L, D] by cos/sin [B, L, D]."""
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    return x * cos + rotate_half(x) * sin


def signed_sin(sin: torch.Tensor) -> torch.Tensor:
    """sin [..., D] with its first half negated, for `apply_rotary_signed`."""
    half = sin.shape[-1] // 2
    return torch.cat((-sin[..., :half], sin[..., half:]), dim=-1)


def apply_rotary_signed(x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor) -> torch.Tensor:
    """`apply_rotary` for x [B, H, L, D] and cos/`signed_sin(sin)` already broadcastable to it ([B, 1, L, D]).

    NOTE: bit-identical to `apply_rotary` (moving the sign from x to sin is exact): roll replaces
    rotate_half's slices, neg and cat, and the unsqueezes are done once per step by the caller;
    4 ops instead of 9 per layer (10.5 -> 6.3 us per layer, SmolLM2 decode, 1 thread).
    """
    return x * cos + x.roll(x.shape[-1] // 2, -1) * sin_signed


# ---------------------------------------------------------------------------------------------
# KV cache and attention
# ---------------------------------------------------------------------------------------------


@dataclass
class KVCache:
    """Keys and values of every layer for one batch, each [B, num_kv_heads, seq_len, head_dim].

    Grown by concatenation. Invariant: all layers hold the same `seq_len` between forward calls.
    """

    num_layers: int
    keys: list[torch.Tensor | None] = field(default_factory=list)
    values: list[torch.Tensor | None] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not self.keys:
            self.keys = [None] * self.num_layers
            self.values = [None] * self.num_layers

    @property
    def seq_len(self) -> int:
        k = self.keys[0]
        return 0 if k is None else int(k.shape[2])

    def update(self, layer_idx: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Append this step's k/v for one layer; return the layer's full k/v."""
        past_k, past_v = self.keys[layer_idx], self.values[layer_idx]
        if past_k is not None and past_v is not None:
            k = torch.cat((past_k, k), dim=2)
            v = torch.cat((past_v, v), dim=2)
        self.keys[layer_idx], self.values[layer_idx] = k, v
        return k, v


def causal_mask(
    q_len: int, kv_len: int, device: torch.device, sliding_window: int | None = None
) -> torch.Tensor:
    """Boolean mask [q_len, kv_len], True where query i (absolute position kv_len - q_len + i) may
    attend key j: j <= i_abs and, with a window, i_abs - j < sliding_window (the HF convention)."""
    q_pos = torch.arange(kv_len - q_len, kv_len, device=device)[:, None]
    k_pos = torch.arange(kv_len, device=device)[None, :]
    mask = k_pos <= q_pos
    if sliding_window is not None:
        mask = mask & (q_pos - k_pos < sliding_window)
    return mask


def sdpa(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None,
    scale: float | None = None,
) -> torch.Tensor:
    """Attention for q [B, Hq, Lq, D] over k/v [B, Hkv, Lk, D] (GQA: Hq a multiple of Hkv).

    `mask` is boolean (True = attend), broadcastable to [B, Hq, Lq, Lk].
    """
    # NOTE: `enable_gqa` reads each kv head for its group of query heads in place: bit-identical
    # to repeat_interleave (checked), and 2.5x faster for a SmolLM2 decode step (no k/v copies).
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=q.shape[1] != k.shape[1])


class Attention(nn.Module):
    """Multi-head attention with GQA, optional q/k RMSNorm (Qwen3) and optional qkv bias (Qwen2).

    `forward` takes precomputed rotary cos/sin so the caller chooses the RoPE flavour (plain,
    multimodal/interleaved, or none).
    """

    def __init__(
        self,
        hidden_size: int,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        *,
        qkv_bias: bool = False,
        o_bias: bool = False,
        qk_norm: bool = False,
        norm_eps: float = 1e-6,
        sliding_window: int | None = None,
    ) -> None:
        super().__init__()
        if num_heads % num_kv_heads != 0:
            raise ValueError(f"num_heads={num_heads} is not a multiple of num_kv_heads={num_kv_heads}")
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.sliding_window = sliding_window
        self.q_proj = nn.Linear(hidden_size, num_heads * head_dim, bias=qkv_bias)
        self.k_proj = nn.Linear(hidden_size, num_kv_heads * head_dim, bias=qkv_bias)
        self.v_proj = nn.Linear(hidden_size, num_kv_heads * head_dim, bias=qkv_bias)
        self.o_proj = nn.Linear(num_heads * head_dim, hidden_size, bias=o_bias)
        # Set by `quant.fuse_projections`: q, k and v as one matmul (rows concatenated).
        self.qkv_proj: nn.Module | None = None
        self.qkv_sizes: tuple[int, ...] = ()
        self.q_norm = RMSNorm(head_dim, norm_eps) if qk_norm else None
        self.k_norm = RMSNorm(head_dim, norm_eps) if qk_norm else None

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor | None,
        sin: torch.Tensor | None,
        kv_cache: KVCache | PagedAttention | None = None,
        layer_idx: int = 0,
        extra_mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """x [B, L, hidden]; `extra_mask` (bool [B, 1, L, Lk], True = attend) is ANDed with the
        causal mask, e.g. for left padding in a batch. With an `AttentionContext` (paged cache),
        x is [1, num_rows, hidden]: the flat tokens of a ragged batch."""
        bsz, q_len, _ = x.shape
        is_paged = kv_cache is not None and not isinstance(kv_cache, KVCache)
        q, k, v = self.project(x, cos, sin, is_paged)
        if kv_cache is not None and not isinstance(kv_cache, KVCache):
            out = kv_cache.attend(layer_idx, q, k, v, self.sliding_window)
        else:
            if kv_cache is not None:
                k, v = kv_cache.update(layer_idx, k, v)
            # NOTE: one new token sees every cached key (without a window): no mask, a faster kernel.
            mask = None if q_len == 1 and self.sliding_window is None else causal_mask(
                q_len, k.shape[2], x.device, self.sliding_window
            )
            if extra_mask is not None:
                mask = extra_mask if mask is None else mask & extra_mask
            out = sdpa(q, k, v, mask)
        return self.output(out)

    def project(
        self, x: torch.Tensor, cos: torch.Tensor | None, sin: torch.Tensor | None, is_paged: bool
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [B, L, hidden] -> rotated q [B, H, L, D] and k, v [B, H_kv, L, D] (before the cache).

        `is_paged`: cos/sin are the paged path's (cos [1, 1, T, D] and `signed_sin`, see `forward_paged`)."""
        bsz, q_len, _ = x.shape
        rotary = apply_rotary_signed if is_paged else apply_rotary
        if self.qkv_proj is not None and self.q_norm is None and cos is not None and sin is not None:
            # Fused: rotate the q and k heads together (half the small rope ops of a decode step).
            qkv = self.qkv_proj(x).view(bsz, q_len, -1, self.head_dim).transpose(1, 2)
            qk = rotary(qkv[:, : self.num_heads + self.num_kv_heads], cos, sin)
            q, k = qk.split((self.num_heads, self.num_kv_heads), dim=1)
            v = qkv[:, self.num_heads + self.num_kv_heads :]
        else:
            if self.qkv_proj is not None:
                q, k, v = self.qkv_proj(x).split(self.qkv_sizes, dim=-1)
            else:
                q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
            q = q.view(bsz, q_len, self.num_heads, self.head_dim)
            k = k.view(bsz, q_len, self.num_kv_heads, self.head_dim)
            v = v.view(bsz, q_len, self.num_kv_heads, self.head_dim)
            if self.q_norm is not None and self.k_norm is not None:
                q, k = self.q_norm(q), self.k_norm(k)
            q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
            if cos is not None and sin is not None:
                q, k = rotary(q, cos, sin), rotary(k, cos, sin)
        return q, k, v

    def output(self, out: torch.Tensor) -> torch.Tensor:
        """Attention output [B, H, L, D] -> o_proj of its heads, [B, L, hidden]."""
        bsz, _, q_len, _ = out.shape
        return self.o_proj(out.transpose(1, 2).reshape(bsz, q_len, -1))


class DecoderLayer(nn.Module):
    """Pre-norm residual block shared by Llama, Qwen and the Qwen3-Omni decoders:
    `x + attn(norm(x))`, then `x + mlp(norm(x))` (dense or MoE `mlp`); HF parameter names."""

    def __init__(self, self_attn: Attention, mlp: nn.Module, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.self_attn = self_attn
        self.mlp = mlp
        self.input_layernorm = RMSNorm(hidden_size, eps)
        self.post_attention_layernorm = RMSNorm(hidden_size, eps)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor | None,
        sin: torch.Tensor | None,
        kv_cache: KVCache | PagedAttention | None,
        layer_idx: int,
        extra_mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, kv_cache, layer_idx, extra_mask)
        return x + self.mlp(self.post_attention_layernorm(x))

    def finish(self, x: torch.Tensor, attn_out: torch.Tensor) -> torch.Tensor:
        """The layer after its attention: x [B, L, hidden] and the attention output [B, H, L, D]."""
        x = x + self.self_attn.output(attn_out)
        return x + self.mlp(self.post_attention_layernorm(x))
