"""Qwen3-Omni thinker: audio tower + Qwen3-MoE text decoder with interleaved M-RoPE + lm_head.

Module tree and parameter names equal transformers' `Qwen3OmniMoeThinkerForConditionalGeneration`
(`model.audio_tower.*`, `model.language_model.*`, `lm_head`), except that the vision tower
(`model.visual.*`) is not built: those keys are to be skipped when loading (`IGNORED_STATE_PREFIXES`).
Images and videos come in as the tower's outputs (`visual.VisualInputs`): embeddings for their
placeholder rows and DeepStack features added at those rows after the first decoder layers.
No buffers (rotary tables are computed per call), so the model can be built on the meta device.
The caller owns the KV cache and positions; `forward` runs one prefill or decode step.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from voice_server.models.layers import Attention, DecoderLayer, KVCache, RMSNorm, SwiGLU
from voice_server.models.paged import AttentionContext
from voice_server.models.qwen3_omni.audio.encoder import AudioEncoder
from voice_server.models.qwen3_omni.moe import SparseMoeBlock
from voice_server.models.qwen3_omni.mrope import POSITION_DTYPES, MRoPE
from voice_server.models.qwen3_omni.thinker.config import ThinkerConfig, ThinkerTextConfig
from voice_server.models.qwen3_omni.thinker.visual import Deepstack, VisualInputs, visual_deepstack
from voice_server.models.shapes import FLOATING, expect_shapes


@dataclass
class ThinkerOutput:
    logits: torch.Tensor  # [B, L, vocab]
    inputs_embeds: torch.Tensor  # [B, L, H]: token embeddings, media features scattered in (HF hidden_states[0])
    accepted_hidden: torch.Tensor | None  # [B, L, H]: HF hidden_states[accept_hidden_layer], if asked for
    last_hidden: torch.Tensor  # [B, L, H]: after the final norm


@dataclass(frozen=True)
class ThinkerPagedOutput:
    logits: torch.Tensor  # [S, vocab] at the rows `logits_indices` chose
    inputs_embeds: torch.Tensor  # [T, H]: what every row was fed (the talker prefill reads it)
    accepted_hidden: torch.Tensor | None  # [T, H]: HF hidden_states[accept_hidden_layer] of every row, if asked


def create_decoder_layer(cfg: ThinkerTextConfig, layer_idx: int) -> DecoderLayer:
    attn = Attention(
        cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim,
        qkv_bias=cfg.attention_bias, o_bias=cfg.attention_bias, qk_norm=True, norm_eps=cfg.rms_norm_eps,
    )
    mlp: SparseMoeBlock | SwiGLU
    if cfg.is_moe_layer(layer_idx):
        mlp = SparseMoeBlock(
            cfg.hidden_size, cfg.moe_intermediate_size, cfg.num_experts, cfg.num_experts_per_tok,
            cfg.norm_topk_prob,
        )
    else:
        mlp = SwiGLU(cfg.hidden_size, cfg.intermediate_size)
    return DecoderLayer(attn, mlp, cfg.hidden_size, cfg.rms_norm_eps)


class ThinkerTextModel(nn.Module):
    def __init__(self, cfg: ThinkerTextConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList([create_decoder_layer(cfg, i) for i in range(cfg.num_hidden_layers)])
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.rotary = MRoPE(cfg.head_dim, cfg.rope_theta, cfg.mrope_section)


class ThinkerBody(nn.Module):
    """HF `Qwen3OmniMoeThinkerModel` without the vision tower."""

    def __init__(self, cfg: ThinkerConfig) -> None:
        super().__init__()
        self.audio_tower = AudioEncoder(cfg.audio)
        self.language_model = ThinkerTextModel(cfg.text)


def _scatter(
    embeds: torch.Tensor, input_ids: torch.Tensor, token_id: int, features: torch.Tensor | None, kind: str
) -> torch.Tensor:
    """`embeds` [B, L, H] with the rows holding `token_id` replaced, in order, by `features` [N, H]."""
    is_placeholder = input_ids == token_id
    num_placeholders = int(is_placeholder.sum())
    num_features = 0 if features is None else features.shape[0]
    if num_placeholders != num_features:
        raise ValueError(f"{num_placeholders} {kind} placeholder tokens but {num_features} {kind} embeddings")
    if features is None or not num_features:
        return embeds
    return embeds.masked_scatter(is_placeholder[..., None], features.to(embeds.dtype))


def _padding_mask(attention_mask: torch.Tensor, q_len: int) -> torch.Tensor:
    """[B, 1, q_len, Lk] from a key mask [B, Lk] (1 = real token). Padding queries may see every key so
    their (unused) rows stay finite."""
    keys = attention_mask.bool()
    pad_queries = ~keys[:, -q_len:]
    return keys[:, None, None, :] | pad_queries[:, None, :, None]


class ThinkerModel(nn.Module):
    IGNORED_STATE_PREFIXES = ("model.visual.",)

    def __init__(self, cfg: ThinkerConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.model = ThinkerBody(cfg)
        self.lm_head = nn.Linear(cfg.text.hidden_size, cfg.text.vocab_size, bias=False)

    def encode_audio(
        self, input_features: torch.Tensor, feature_lens: torch.Tensor, *, chunk_pad_len: int | None = None
    ) -> torch.Tensor:
        """Packed log-mel [num_mel_bins, sum(feature_lens)] -> audio tokens [N, hidden] (`AudioEncoder.forward`)."""
        return self.model.audio_tower(input_features, feature_lens, chunk_pad_len=chunk_pad_len)

    def embed(
        self, input_ids: torch.Tensor, audio_embeds: torch.Tensor | None = None, visual: VisualInputs | None = None
    ) -> torch.Tensor:
        """Token embeddings [B, L, H] (or [L, H] for input_ids [L]) with the audio, image and video
        placeholders replaced, in order, by `audio_embeds` [N, H] and `visual`'s image / video embeddings.
        A count mismatch is a ValueError."""
        embeds = self.model.language_model.embed_tokens(input_ids)
        embeds = _scatter(embeds, input_ids, self.cfg.audio_token_id, audio_embeds, "audio")
        image, video = (None, None) if visual is None else (visual.image_embeds, visual.video_embeds)
        embeds = _scatter(embeds, input_ids, self.cfg.image_token_id, image, "image")
        return _scatter(embeds, input_ids, self.cfg.video_token_id, video, "video")

    def deepstack(self, input_ids: torch.Tensor, visual: VisualInputs | None) -> Deepstack | None:
        """`visual`'s DeepStack features at their placeholder rows of input_ids [L] or [B, L] (flattened)."""
        if visual is None:
            return None
        return visual_deepstack(input_ids, self.cfg.image_token_id, self.cfg.video_token_id, visual)

    def _check_deepstack(self, deepstack: Deepstack | None, num_rows: int) -> None:
        if deepstack is None:
            return
        num_layers = self.cfg.text.num_hidden_layers
        if deepstack.num_layers > num_layers:
            raise ValueError(f"{deepstack.num_layers} DeepStack features for {num_layers} decoder layers")
        if deepstack.embeds.shape[2] != self.cfg.text.hidden_size:
            raise ValueError(
                f"DeepStack features are {deepstack.embeds.shape[2]} wide, the hidden size is "
                f"{self.cfg.text.hidden_size}"
            )
        if deepstack.rows.numel() and int(deepstack.rows.max()) >= num_rows:
            raise ValueError(f"DeepStack row {int(deepstack.rows.max())} is outside the {num_rows} rows of the step")

    def forward(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor,
        kv_cache: KVCache | None = None,
        audio_embeds: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        accept_hidden_layer: int | None = None,
        inputs_embeds: torch.Tensor | None = None,
        visual: VisualInputs | None = None,
    ) -> ThinkerOutput:
        """One prefill or decode step.

        input_ids [B, L]; position_ids [3, B, L] int64 or float32 (see `rope.get_rope_index` /
        `decode_position_ids`); attention_mask [B, cached + L] (1 = real token) only for padded batches;
        `accept_hidden_layer` k returns the output of decoder layer k - 1 (k = 0: the embeddings;
        k = num_layers: post-norm, as HF's recorded hidden states); `inputs_embeds` overrides the
        embedding lookup (then the caller has scattered every feature). `visual`: the images and
        videos of this step's placeholders (a prefill holding whole blocks), embedded unless
        `inputs_embeds` is given, and their DeepStack features added after the first decoder layers.
        """
        expect_shapes(
            ("input_ids", input_ids, "[B, L]", torch.long),
            ("position_ids", position_ids, "[3, B, L]", POSITION_DTYPES),
            ("inputs_embeds", inputs_embeds, "[B, L, H]", FLOATING), ("audio_embeds", audio_embeds, "[N, H]", FLOATING),
            ("attention_mask", attention_mask, "[B, Lk]", None), dims={"H": self.cfg.text.hidden_size},
        )
        text = self.model.language_model
        num_layers = len(text.layers)
        if accept_hidden_layer is not None and not 0 <= accept_hidden_layer <= num_layers:
            raise ValueError(f"accept_hidden_layer={accept_hidden_layer} is outside [0, {num_layers}]")
        if inputs_embeds is None:
            inputs_embeds = self.embed(input_ids, audio_embeds, visual)
        deepstack = self.deepstack(input_ids, visual)
        self._check_deepstack(deepstack, input_ids.numel())
        cos, sin = text.rotary(position_ids, inputs_embeds.dtype)
        extra_mask = None if attention_mask is None else _padding_mask(attention_mask, inputs_embeds.shape[1])
        x = inputs_embeds
        accepted = x if accept_hidden_layer == 0 else None
        for i, layer in enumerate(text.layers):
            x = layer(x, cos, sin, kv_cache, i, extra_mask)
            if accept_hidden_layer == i + 1 and i + 1 < num_layers:
                accepted = x
            # NOTE: after the capture: the reference records each decoder layer's own output.
            if deepstack is not None and i < deepstack.num_layers:
                x = deepstack.add_to(x, i)
        x = text.norm(x)
        if accept_hidden_layer == num_layers:
            accepted = x
        return ThinkerOutput(
            logits=self.lm_head(x), inputs_embeds=inputs_embeds, accepted_hidden=accepted, last_hidden=x
        )

    def forward_paged(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        ctx: AttentionContext,
        logits_indices: torch.Tensor,
        inputs_embeds: torch.Tensor | None = None,
        accept_hidden_layer: int | None = None,
        deepstack: Deepstack | None = None,
    ) -> ThinkerPagedOutput:
        """One step of a ragged batch over the paged cache: flat input_ids [T] (prefill chunks and
        decode rows of many sequences, padding last), positions [T] int64 (text and audio only: all
        M-RoPE axes equal) or [3, T] int64 / float32 (`get_rope_index`'s, per row) -> logits [S, V]
        of rows `logits_indices` [S].

        `inputs_embeds` [T, H] replaces the embedding lookup: the caller scatters audio, image and
        video embeddings into the placeholder rows itself (e.g. rows of `embed(prompt_ids, audio,
        visual)` for the prompt positions a chunk holds). `deepstack`: the DeepStack features of the
        step's image / video rows, `rows` indexing [0, T); a chunk carries the features of its own rows
        only (`visual_deepstack(prompt_ids, ..).slice_rows(start, end, row_offset)`, one step's chunks
        joined by `Deepstack.concat`), so a prefill may cut a block anywhere. `accept_hidden_layer` as
        in `forward`. Only the rows in `logits_indices` go through the final norm and lm_head (and
        every row when the accepted hidden state is the post-norm one).
        """
        text = self.model.language_model
        expect_shapes(
            ("input_ids", input_ids, "[T]", torch.long),
            ("positions", positions, "[T] | [3, T]", POSITION_DTYPES),
            ("logits_indices", logits_indices, "[S]", torch.long),
            ("inputs_embeds", inputs_embeds, "[T, H]", FLOATING), dims={"H": self.cfg.text.hidden_size},
        )
        num_layers = len(text.layers)
        if accept_hidden_layer is not None and not 0 <= accept_hidden_layer <= num_layers:
            raise ValueError(f"accept_hidden_layer={accept_hidden_layer} is outside [0, {num_layers}]")
        self._check_deepstack(deepstack, input_ids.shape[0])
        if inputs_embeds is None:
            inputs_embeds = text.embed_tokens(input_ids)
        cos, sin = text.rotary.paged_cos_sin(positions, self.cfg.text.max_position_embeddings, inputs_embeds.dtype)
        x = inputs_embeds[None]
        accepted = inputs_embeds if accept_hidden_layer == 0 else None
        for i, layer in enumerate(text.layers):
            x = layer(x, cos, sin, ctx, i)
            if accept_hidden_layer == i + 1 and i + 1 < num_layers:
                accepted = x[0]
            if deepstack is not None and i < deepstack.num_layers:  # NOTE: after the capture, as in `forward`
                x = deepstack.add_to(x, i)
        if accept_hidden_layer == num_layers:
            accepted = text.norm(x[0])
            hidden = accepted.index_select(0, logits_indices)
        else:
            hidden = text.norm(x[0].index_select(0, logits_indices))
        return ThinkerPagedOutput(self.lm_head(hidden), inputs_embeds, accepted)
