"""Code predictor ("MTP"): a small dense Qwen3 decoder that fills codebooks 1..G-1 of one frame.

Parameter names equal transformers' `Qwen3OmniMoeTalkerCodePredictorModelForConditionalGeneration`
(`model.layers.*`, `model.norm`, `model.codec_embedding.{k}`, `lm_head.{k}`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import NamedTuple

import torch
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
)
from voice_server.models.qwen3_omni.talker.config import CodePredictorConfig
from voice_server.models.qwen3_omni.talker.sampling import (
    CodebookSampling,
    select_token_rows,
    select_tokens,
    select_with_noise,
)
from voice_server.models.shapes import FLOATING, expect_shapes


def create_decoder_layer(cfg: CodePredictorConfig, layer_idx: int) -> DecoderLayer:
    attn = Attention(
        cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim,
        qk_norm=True, norm_eps=cfg.rms_norm_eps, sliding_window=cfg.layer_window(layer_idx),
    )
    return DecoderLayer(attn, SwiGLU(cfg.hidden_size, cfg.intermediate_size), cfg.hidden_size, cfg.rms_norm_eps)


class CodePredictorModel(nn.Module):
    def __init__(self, cfg: CodePredictorConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.layers = nn.ModuleList(create_decoder_layer(cfg, i) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        # codec_embedding[k - 1] embeds code k (k = 1..G-1); code 0 uses the talker's own table.
        self.codec_embedding = nn.ModuleList(
            nn.Embedding(cfg.vocab_size, cfg.hidden_size) for _ in range(cfg.num_code_groups - 1)
        )
        self._inv_freq: dict[torch.device, torch.Tensor] = {}

    def rotary(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [B, L] -> cos, sin [B, L, head_dim] (plain 1-D RoPE)."""
        device = positions.device
        if device not in self._inv_freq:
            self._inv_freq[device] = rope_inv_freq(self.cfg.head_dim, self.cfg.rope_theta).to(device)
        return rope_cos_sin(rope_angles(positions, self._inv_freq[device]), dtype)

    def forward(self, inputs_embeds: torch.Tensor, positions: torch.Tensor, kv_cache: KVCache) -> torch.Tensor:
        """inputs_embeds [B, L, H], positions [B, L] -> post-norm hidden [B, L, H]."""
        expect_shapes(
            ("inputs_embeds", inputs_embeds, "[B, L, H]", FLOATING), ("positions", positions, "[B, L]", torch.long),
            dims={"H": self.cfg.hidden_size},
        )
        cos, sin = self.rotary(positions, inputs_embeds.dtype)
        return self.run_layers(inputs_embeds, cos, sin, kv_cache)

    def run_layers(
        self, inputs_embeds: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv_cache: KVCache
    ) -> torch.Tensor:
        x = inputs_embeds
        for i, layer in enumerate(self.layers):
            x = layer(x, cos, sin, kv_cache, i)
        return self.norm(x)


class FrameFill(NamedTuple):
    codes: torch.Tensor  # [B, G - 1] codes 1..G-1
    embeds: torch.Tensor  # [B, G - 1, H] codec_embedding[k - 1](code k), the feedback summands
    logits: torch.Tensor  # [B, G - 1, V] raw lm_head[k - 1] logits that chose code k


class CodePredictor(nn.Module):
    def __init__(self, cfg: CodePredictorConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.model = CodePredictorModel(cfg)
        self.lm_head = nn.ModuleList(
            nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False) for _ in range(cfg.num_code_groups - 1)
        )

    def fill(
        self,
        talker_hidden: torch.Tensor,
        code0_embed: torch.Tensor,
        params: CodebookSampling | None = None,
        generator: torch.Generator | None = None,
    ) -> FrameFill:
        """Codes 1..G-1 of one frame from the talker's last post-norm hidden [B, H] and
        talker.codec_embedding(code0) [B, H], with a fresh KV cache: a 2-position prefill scored by
        lm_head[0], then G-2 single-position steps feeding codec_embedding[k-1](code k) into lm_head[k]."""
        expect_shapes(
            ("talker_hidden", talker_hidden, "[B, H]", FLOATING), ("code0_embed", code0_embed, "[B, H]", FLOATING),
            dims={"H": self.cfg.hidden_size},
        )
        params = params or CodebookSampling()
        return self._fill(talker_hidden, code0_embed, lambda logits: select_tokens(logits, params, generator))

    def fill_rows(
        self,
        talker_hidden: torch.Tensor,
        code0_embed: torch.Tensor,
        params: Sequence[CodebookSampling],
        generators: Sequence[torch.Generator | None],
    ) -> FrameFill:
        """`fill` for S sequences of a batch, row i selecting with its own `params[i]` / `generators[i]`
        (talker_hidden, code0_embed [S, H])."""
        expect_shapes(
            ("talker_hidden", talker_hidden, "[S, H]", FLOATING), ("code0_embed", code0_embed, "[S, H]", FLOATING),
            dims={"H": self.cfg.hidden_size},
        )
        return self._fill(talker_hidden, code0_embed, lambda logits: select_token_rows(logits, params, generators))

    def fill_with_noise(
        self, talker_hidden: torch.Tensor, code0_embed: torch.Tensor, params: CodebookSampling, noise: torch.Tensor,
    ) -> FrameFill:
        """`fill` for S rows sharing `params`, drawing code k with pre-drawn Exp(1) noise[:, k - 1]
        (noise [S, G-1, codebook]; `select_with_noise`): no generator call, so it can be captured."""
        expect_shapes(
            ("talker_hidden", talker_hidden, "[S, H]", FLOATING), ("code0_embed", code0_embed, "[S, H]", FLOATING),
            ("noise", noise, "[S, K, C]", FLOATING),
            dims={"H": self.cfg.hidden_size, "K": self.cfg.num_code_groups - 1, "C": self.cfg.vocab_size},
        )
        groups = iter(range(self.cfg.num_code_groups - 1))
        return self._fill(talker_hidden, code0_embed,
                          lambda logits: select_with_noise(logits, params, noise[:, next(groups)]))

    def _fill(
        self, talker_hidden: torch.Tensor, code0_embed: torch.Tensor, select: Callable[[torch.Tensor], torch.Tensor]
    ) -> FrameFill:
        bsz = talker_hidden.shape[0]
        # NOTE: a fresh contiguous cache per frame: its shapes (B rows, 2 then 1 positions per pass, at
        # most G keys) are the same every frame, whatever the batch's sequences are doing.
        kv_cache = KVCache(len(self.model.layers))
        positions = torch.arange(self.cfg.num_code_groups, device=talker_hidden.device).expand(bsz, -1)
        # NOTE: one rope table for the whole frame (positions 0..G-1), sliced per pass.
        cos, sin = self.model.rotary(positions, talker_hidden.dtype)
        x = torch.stack((talker_hidden, code0_embed), dim=1)
        codes: list[torch.Tensor] = []
        embeds: list[torch.Tensor] = []
        logits: list[torch.Tensor] = []
        for k in range(self.cfg.num_code_groups - 1):
            start = 0 if k == 0 else k + 1
            end = start + x.shape[1]
            hidden = self.model.run_layers(x, cos[:, start:end], sin[:, start:end], kv_cache)
            step_logits = self.lm_head[k](hidden[:, -1])
            code = select(step_logits)
            embed = self.model.codec_embedding[k](code)
            codes.append(code)
            embeds.append(embed)
            logits.append(step_logits)
            x = embed.unsqueeze(1)
        return FrameFill(torch.stack(codes, dim=1), torch.stack(embeds, dim=1), torch.stack(logits, dim=1))
