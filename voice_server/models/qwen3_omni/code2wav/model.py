"""Code2Wav vocoder: quantizer embedding average -> sliding-window causal transformer -> ConvNeXt
upsampling -> SnakeBeta decoder -> PCM in [-1, 1].

Parameter names equal transformers' `Qwen3OmniMoeCode2Wav` in-memory names. `forward` decodes a
whole code sequence; `decode_chunk` streams (see streaming.py for the state and exactness argument).
"""

from __future__ import annotations

import torch
from torch import nn

from voice_server.models.layers import (
    Attention,
    KVCache,
    RMSNorm,
    SwiGLU,
    rope_angles,
    rope_cos_sin,
    rope_inv_freq,
)
from voice_server.models.qwen3_omni.code2wav.config import Code2WavConfig
from voice_server.models.qwen3_omni.code2wav.convs import (
    CausalConv,
    CausalTransConv,
    ConvNeXtBlock,
    DecoderBlock,
    SnakeBeta,
)
from voice_server.models.qwen3_omni.code2wav.streaming import (
    Code2WavStreamState,
    conv_stages,
    decode_chunk,
    earliest_input,
    new_stream_state,
)
from voice_server.models.shapes import expect_shape


class LayerScale(nn.Module):
    def __init__(self, dim: int, init: float) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.full((dim,), init))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.scale * x


class TransformerLayer(nn.Module):
    def __init__(self, cfg: Code2WavConfig) -> None:
        super().__init__()
        self.self_attn = Attention(
            cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim,
            qkv_bias=cfg.attention_bias, o_bias=cfg.attention_bias, sliding_window=cfg.sliding_window,
        )
        self.mlp = SwiGLU(cfg.hidden_size, cfg.intermediate_size)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn_layer_scale = LayerScale(cfg.hidden_size, cfg.layer_scale_initial_scale)
        self.mlp_layer_scale = LayerScale(cfg.hidden_size, cfg.layer_scale_initial_scale)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv_cache: KVCache | None,
                layer_idx: int) -> torch.Tensor:
        attn = self.self_attn(self.input_layernorm(x), cos, sin, kv_cache, layer_idx)
        x = x + self.self_attn_layer_scale(attn)
        return x + self.mlp_layer_scale(self.mlp(self.post_attention_layernorm(x)))


class PreTransformer(nn.Module):
    def __init__(self, cfg: Code2WavConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.layers = nn.ModuleList([TransformerLayer(cfg) for _ in range(cfg.num_hidden_layers)])
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(
        self, x: torch.Tensor, start_pos: int | torch.Tensor = 0, kv_cache: KVCache | None = None
    ) -> torch.Tensor:
        """x [B, T, H] at absolute frame positions start_pos.. -> post-norm hidden [B, T, H].

        `start_pos` is one int for every row, or a long tensor [B] of per-row starts (streams at
        different positions batched together; their caches must have the same length).

        With `kv_cache`, the cache holds the keys/values of the frames just before start_pos and is
        trimmed afterwards to the sliding window (window - 1 frames), which is all a later query sees.
        """
        bsz, seq_len, _ = x.shape
        # NOTE: inv_freq is recomputed per call (no buffer), so the module has no state to restore
        # after meta-device construction.
        inv_freq = rope_inv_freq(self.cfg.head_dim, self.cfg.rope_theta)
        if isinstance(start_pos, torch.Tensor):
            positions = start_pos.to(x.device)[:, None] + torch.arange(seq_len, device=x.device)[None, :]
        else:
            positions = torch.arange(start_pos, start_pos + seq_len, device=x.device).expand(bsz, seq_len)
        cos, sin = rope_cos_sin(rope_angles(positions, inv_freq), x.dtype)
        for i, layer in enumerate(self.layers):
            x = layer(x, cos, sin, kv_cache, i)
        if kv_cache is not None:
            keep = self.cfg.sliding_window - 1
            for i in range(len(self.layers)):
                k, v = kv_cache.keys[i], kv_cache.values[i]
                if k is not None and v is not None:
                    kv_cache.keys[i] = k[:, :, k.shape[2] - min(keep, k.shape[2]) :]
                    kv_cache.values[i] = v[:, :, v.shape[2] - min(keep, v.shape[2]) :]
        return self.norm(x)


class Code2Wav(nn.Module):
    def __init__(self, cfg: Code2WavConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.total_upsample = cfg.total_upsample
        self.pre_transformer = PreTransformer(cfg)
        self.code_embedding = nn.Embedding(cfg.codebook_size * cfg.num_quantizers, cfg.hidden_size)
        dim = cfg.hidden_size
        self.upsample = nn.ModuleList(
            nn.ModuleList([CausalTransConv(dim, dim, ratio, ratio), ConvNeXtBlock(dim)])
            for ratio in cfg.upsampling_ratios
        )
        decoder: list[nn.Module] = [CausalConv(cfg.hidden_size, cfg.decoder_dim, 7)]
        decoder += [DecoderBlock(cfg.decoder_dim // 2**i, rate) for i, rate in enumerate(cfg.upsample_rates)]
        out_dim = cfg.decoder_dim // 2 ** len(cfg.upsample_rates)
        decoder += [SnakeBeta(out_dim), CausalConv(out_dim, 1, 7)]
        self.decoder = nn.ModuleList(decoder)
        self._stages = conv_stages(cfg)
        assert len(self._stages) == len(self.conv_ops()), "conv_stages(cfg) out of sync with conv_ops()"

    def embed(self, codes: torch.Tensor) -> torch.Tensor:
        """codes [B, G, T] (each in [0, codebook_size)) -> mean of the G quantizer embeddings [B, T, H]."""
        if codes.ndim != 3 or codes.shape[1] != self.cfg.num_quantizers:
            raise ValueError(f"codes must be [B, {self.cfg.num_quantizers}, T], got {tuple(codes.shape)}")
        offset = torch.arange(self.cfg.num_quantizers, device=codes.device)[None, :, None]
        return self.code_embedding(codes + offset * self.cfg.codebook_size).mean(1)

    def conv_ops(self) -> list[nn.Module]:
        """The modules after the transformer in execution order (matches `conv_stages(cfg)`)."""
        ops: list[nn.Module] = []
        for stage in self.upsample:
            ops += list(stage.children())
        for block in self.decoder:
            ops += list(block.block) if isinstance(block, DecoderBlock) else [block]
        return ops

    def decode_hidden(self, hidden: torch.Tensor, keep_tail: bool = False, first_sample: int = 0) -> torch.Tensor:
        """Transformer output [B, H, T] (channels first) -> PCM [B, T * total_upsample - lookahead]
        clamped to [-1, 1], or [B, T * total_upsample] with `keep_tail` (see CausalTransConv).

        Only samples from `first_sample` on are returned; every stage first drops the inputs those
        samples do not depend on (their outputs equal a full decode's within float rounding)."""
        needed = [first_sample]
        for stage in reversed(self._stages):
            needed.append(earliest_input(stage, needed[-1]))
        needed.reverse()  # needed[k]: first input index op k must see; needed[-1] == first_sample
        x, offset = hidden, 0  # offset: index of x[..., 0] in the current stage's time axis
        for op, stage, first_input in zip(self.conv_ops(), self._stages, needed):
            if first_input > offset:
                x, offset = x[..., first_input - offset :], first_input
            if isinstance(op, CausalTransConv):
                x, offset = op(x, keep_tail), offset * stage[2]
            else:
                x = op(x)
        x = x[..., max(0, first_sample - offset) :]
        return x.clamp(min=-1.0, max=1.0)[:, 0]

    def forward(self, codes: torch.Tensor, keep_tail: bool = False) -> torch.Tensor:
        """Full-sequence decode, codes [B, G, T] -> PCM [B, 1, T * total_upsample - lookahead] exactly
        like the reference; `keep_tail` appends the trailing lookahead samples the reference drops."""
        expect_shape("codes", codes, "[B, G, T]", torch.long, {"G": self.cfg.num_quantizers})
        hidden = self.pre_transformer(self.embed(codes))
        return self.decode_hidden(hidden.transpose(1, 2), keep_tail)[:, None]

    def new_stream_state(
        self, batch_size: int = 1, left_context_frames: int | None = None
    ) -> Code2WavStreamState:
        return new_stream_state(self.cfg, batch_size, left_context_frames)

    def decode_chunk(
        self, codes: torch.Tensor, state: Code2WavStreamState, is_last: bool = False
    ) -> tuple[torch.Tensor, Code2WavStreamState]:
        return decode_chunk(self, codes, state, is_last)
