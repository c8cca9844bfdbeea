"""Qwen3-Omni talker: MoE decoder predicting codebook 0, plus the MTP fill and the feedback rule.

Parameter names equal transformers' `Qwen3OmniMoeTalkerForConditionalGeneration` in-memory names, so
`Talker(cfg).load_state_dict(hf_talker.state_dict())` works.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from voice_server.models.layers import Attention, DecoderLayer, KVCache, RMSNorm
from voice_server.models.paged import PagedAttention
from voice_server.models.qwen3_omni.moe import SparseMoeBlock
from voice_server.models.qwen3_omni.mrope import POSITION_DTYPES, MRoPE
from voice_server.models.qwen3_omni.talker.code_predictor import CodePredictor
from voice_server.models.qwen3_omni.talker.config import TalkerConfig
from voice_server.models.qwen3_omni.talker.sampling import TalkerSampling, select_tokens
from voice_server.models.sampling import penalize_seen
from voice_server.models.shapes import FLOATING, expect_shapes


def create_decoder_layer(cfg: TalkerConfig) -> DecoderLayer:
    attn = Attention(
        cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim,
        qk_norm=True, norm_eps=cfg.rms_norm_eps,
    )
    # NOTE: every talker layer is MoE with the gated shared expert (HF ignores mlp_only_layers here).
    mlp = SparseMoeBlock(
        cfg.hidden_size, cfg.moe_intermediate_size, cfg.num_experts, cfg.num_experts_per_tok,
        cfg.is_norm_topk_prob, shared_intermediate_size=cfg.shared_expert_intermediate_size,
    )
    return DecoderLayer(attn, mlp, cfg.hidden_size, cfg.rms_norm_eps)


class TalkerModel(nn.Module):
    def __init__(self, cfg: TalkerConfig) -> None:
        super().__init__()
        self.layers = nn.ModuleList(create_decoder_layer(cfg) for _ in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.codec_embedding = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.rotary = MRoPE(cfg.head_dim, cfg.rope_theta, cfg.mrope_section)

    def forward(
        self,
        inputs_embeds: torch.Tensor,
        positions: torch.Tensor,
        kv_cache: KVCache | None,
        key_mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """inputs_embeds [B, L, H]; positions [B, L] or [3, B, L] (t, h, w), int64, or float32 where a video's
        frame times are fractional (`prefill.py`); key_mask [B, Lk] bool (False = left padding) -> post-norm
        hidden [B, L, H]."""
        expect_shapes(
            ("inputs_embeds", inputs_embeds, "[B, L, H]", FLOATING),
            ("positions", positions, "[B, L] | [3, B, L]", POSITION_DTYPES),
            ("key_mask", key_mask, "[B, Lk]", torch.bool),
            dims={"H": self.codec_embedding.embedding_dim},
        )
        cos, sin = self.rotary(positions, inputs_embeds.dtype)
        mask = None if key_mask is None else key_mask[:, None, None, :]
        x = inputs_embeds
        for i, layer in enumerate(self.layers):
            x = layer(x, cos, sin, kv_cache, i, mask)
        return self.norm(x)


class ResizeMLP(nn.Module):
    """thinker width -> talker width (`text_projection` for token embeddings, `hidden_projection`
    for the thinker's accept_hidden_layer state at multimodal positions)."""

    def __init__(self, cfg: TalkerConfig) -> None:
        super().__init__()
        self.linear_fc1 = nn.Linear(cfg.thinker_hidden_size, cfg.intermediate_size, bias=True)
        self.linear_fc2 = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_fc2(F.silu(self.linear_fc1(x)))


class TalkerStepOutput(NamedTuple):
    codes: torch.Tensor  # [B, G]: code 0 from codec_head, codes 1..G-1 from the code predictor
    next_input_embeds: torch.Tensor  # [B, 1, H]: the talker input of the next step
    hidden: torch.Tensor  # [B, H]: post-norm talker hidden at the last position
    logits: torch.Tensor  # [B, V]: raw codec_head logits at the last position


class Talker(nn.Module):
    def __init__(self, cfg: TalkerConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.model = TalkerModel(cfg)
        self.text_projection = ResizeMLP(cfg)
        self.hidden_projection = ResizeMLP(cfg)
        self.codec_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.code_predictor = CodePredictor(cfg.code_predictor)
        self._suppress: dict[torch.device, torch.Tensor] = {}

    def forward(
        self,
        inputs_embeds: torch.Tensor,
        positions: torch.Tensor,
        kv_cache: KVCache | None,
        key_mask: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One prefill or decode pass -> (codec_head logits [B, L, V], post-norm hidden [B, L, H])."""
        hidden = self.model(inputs_embeds, positions, kv_cache, key_mask)
        return self.codec_head(hidden), hidden

    def forward_paged(
        self,
        inputs_embeds: torch.Tensor,
        positions: torch.Tensor,
        ctx: PagedAttention,
        logits_indices: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One pass of a ragged batch over the paged cache: flat inputs_embeds [T, H] (prefill chunks
        and decode rows of many sequences, padding last), positions [T] int64 (all M-RoPE axes equal) or
        [3, T] int64 / float32 (vision prompts, as in `forward`) -> (codec_head logits [S, V], post-norm
        hidden [S, H]) at rows `logits_indices` [S]."""
        expect_shapes(
            ("inputs_embeds", inputs_embeds, "[T, H]", FLOATING),
            ("positions", positions, "[T] | [3, T]", POSITION_DTYPES),
            ("logits_indices", logits_indices, "[S]", torch.long), dims={"H": self.cfg.hidden_size},
        )
        model = self.model
        cos, sin = model.rotary.paged_cos_sin(positions, self.cfg.max_position_embeddings, inputs_embeds.dtype)
        x = inputs_embeds[None]
        for i, layer in enumerate(model.layers):
            x = layer(x, cos, sin, ctx, i)
        hidden = model.norm(x[0].index_select(0, logits_indices))
        return self.codec_head(hidden), hidden

    def suppress_mask(self, device: torch.device) -> torch.Tensor:
        """[V] bool: ids generation never picks for code 0 ([V - 1024, V) except codec EOS)."""
        if device not in self._suppress:
            ids = torch.arange(self.cfg.vocab_size, device=device)
            self._suppress[device] = (ids >= self.cfg.vocab_size - 1024) & (ids != self.cfg.codec_eos_token_id)
        return self._suppress[device]

    def select_code0(
        self,
        logits: torch.Tensor,
        code0_seen: torch.Tensor | None,
        sampling: TalkerSampling,
        generator: torch.Generator | None = None,
    ) -> torch.Tensor:
        """Raw logits [B, V] -> code 0 [B]; marks the choice in `code0_seen` [B, V] in place."""
        scores = logits.float()
        if code0_seen is not None:
            scores = penalize_seen(scores, code0_seen, sampling.repetition_penalty)
        if sampling.is_suppress_control:
            scores = scores.masked_fill(self.suppress_mask(scores.device), float("-inf"))
        code0 = select_tokens(scores, sampling.code0, generator)
        if code0_seen is not None:
            code0_seen.scatter_(1, code0[:, None], True)
        return code0

    def step(
        self,
        inputs_embeds: torch.Tensor,
        positions: torch.Tensor,
        kv_cache: KVCache,
        text_vec: torch.Tensor,
        code0_seen: torch.Tensor | None = None,
        sampling: TalkerSampling | None = None,
        generator: torch.Generator | None = None,
        key_mask: torch.Tensor | None = None,
    ) -> TalkerStepOutput:
        """Fused frame step: talker pass (prefill [B, L, H] or decode [B, 1, H], at `positions` as in
        `TalkerModel.forward`: the prefill's, then `rope.continue_positions`) -> code 0 at the last
        position -> code predictor fills codes 1..G-1 -> next input = sum of all G codebook embeddings
        + `text_vec` [B, H] (the next trailing text vector, or tts_pad once the text ran out).

        `code0_seen` [B, V] bool carries the repetition-penalty history across steps (updated in place).
        NOTE: a row whose code 0 is codec EOS has ended; HF never fills that frame, so the caller drops it.
        """
        expect_shapes(
            ("inputs_embeds", inputs_embeds, "[B, L, H]", FLOATING),
            ("text_vec", text_vec, "[B, H] | [B, 1, H]", FLOATING), dims={"H": self.cfg.hidden_size},
        )
        sampling = sampling or TalkerSampling()
        last_hidden = self.model(inputs_embeds, positions, kv_cache, key_mask)[:, -1]
        last_logits = self.codec_head(last_hidden)
        code0 = self.select_code0(last_logits, code0_seen, sampling, generator)
        code0_embed = self.model.codec_embedding(code0)
        fill = self.code_predictor.fill(last_hidden, code0_embed, sampling.residual, generator)
        codec_sum = torch.cat((code0_embed.unsqueeze(1), fill.embeds), dim=1).sum(1, keepdim=True)
        next_input = codec_sum + text_vec.reshape(codec_sum.shape).to(codec_sum.dtype)
        codes = torch.cat((code0.unsqueeze(1), fill.codes), dim=1)
        return TalkerStepOutput(codes, next_input, last_hidden, last_logits)
