"""Thinker-side configs (audio encoder, MoE text decoder, token ids), read from the checkpoint's config.json.

The vision tower's config is `vision/config.py` (`ThinkerConfig.vision`).
Field defaults are the RELEASED Qwen3-Omni-30B-A3B values, not transformers' class defaults (which are
Qwen2.5-Omni leftovers: e.g. `position_id_per_seconds` 25 vs 13, audio `output_dim` and vision
`out_hidden_size` 3584 vs 2048).
`from_hf_dict` takes the matching sub-dict of config.json; a missing (or null) key keeps the default
(the reading rules are in `voice_server/models/hf_config.py`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from voice_server.models.hf_config import HFSection, as_section, check_positive, read_head_dim, read_rope
from voice_server.models.qwen3_omni.vision.config import VisionEncoderConfig


@dataclasses.dataclass(frozen=True)
class AudioEncoderConfig:
    num_mel_bins: int = 128
    d_model: int = 1280
    encoder_layers: int = 32
    encoder_attention_heads: int = 20
    encoder_ffn_dim: int = 5120
    downsample_hidden_size: int = 480
    output_dim: int = 2048
    max_source_positions: int = 1500
    n_window: int = 50  # conv chunks are 2 * n_window mel frames (1 s)
    n_window_infer: int = 800  # attention windows, in mel frames (a multiple of 2 * n_window)
    activation_function: str = "gelu"

    def __post_init__(self) -> None:
        check_positive(
            self, "num_mel_bins", "d_model", "encoder_layers", "encoder_attention_heads", "encoder_ffn_dim",
            "downsample_hidden_size", "output_dim", "max_source_positions", "n_window", "n_window_infer",
        )
        if self.d_model % self.encoder_attention_heads != 0:
            raise ValueError(
                f"AudioEncoderConfig.d_model={self.d_model} is not a multiple of "
                f"encoder_attention_heads={self.encoder_attention_heads}"
            )
        if self.n_window_infer % (2 * self.n_window) != 0:
            raise ValueError(
                f"AudioEncoderConfig.n_window_infer={self.n_window_infer} is not a multiple of "
                f"2 * n_window={2 * self.n_window}"
            )
        if self.activation_function != "gelu":
            raise ValueError(f"AudioEncoderConfig.activation_function must be 'gelu', got {self.activation_function!r}")

    @classmethod
    def from_hf_dict(cls, d: Mapping[str, Any] | HFSection) -> AudioEncoderConfig:
        return cls(**as_section(d, "thinker_config.audio_config").read_fields(cls))


@dataclasses.dataclass(frozen=True)
class ThinkerTextConfig:
    vocab_size: int = 152064
    hidden_size: int = 2048
    intermediate_size: int = 768  # dense MLP size (only layers listed in mlp_only_layers)
    num_hidden_layers: int = 48
    num_attention_heads: int = 32
    num_key_value_heads: int = 4
    head_dim: int = 128
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1e6
    mrope_section: tuple[int, ...] = (24, 20, 20)  # t/h/w rotary pairs, interleaved
    moe_intermediate_size: int = 768
    num_experts: int = 128
    num_experts_per_tok: int = 8
    norm_topk_prob: bool = True
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()
    attention_bias: bool = False
    max_position_embeddings: int = 65536

    def __post_init__(self) -> None:
        check_positive(
            self, "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
            "head_dim", "rope_theta", "decoder_sparse_step",
        )
        if self.num_attention_heads % self.num_key_value_heads != 0:
            raise ValueError(
                f"ThinkerTextConfig.num_attention_heads={self.num_attention_heads} is not a multiple of "
                f"num_key_value_heads={self.num_key_value_heads}"
            )
        if len(self.mrope_section) != 3 or sum(self.mrope_section) != self.head_dim // 2:
            raise ValueError(
                f"ThinkerTextConfig.mrope_section={self.mrope_section} must have 3 entries summing to "
                f"head_dim // 2 = {self.head_dim // 2}"
            )
        if self.num_experts > 0 and not 0 < self.num_experts_per_tok <= self.num_experts:
            raise ValueError(
                f"ThinkerTextConfig.num_experts_per_tok={self.num_experts_per_tok} must be in [1, num_experts]"
            )

    def is_moe_layer(self, layer_idx: int) -> bool:
        return (
            layer_idx not in self.mlp_only_layers
            and self.num_experts > 0
            and (layer_idx + 1) % self.decoder_sparse_step == 0
        )

    @classmethod
    def from_hf_dict(cls, d: Mapping[str, Any] | HFSection) -> ThinkerTextConfig:
        s = as_section(d, "thinker_config.text_config")
        kw = s.read_fields(cls)
        rope = read_rope(s, cls.rope_theta, rope_types=("default", "mrope"))
        kw["rope_theta"] = rope.theta
        if rope.mrope_section is not None:
            kw["mrope_section"] = rope.mrope_section
        if s.has("hidden_size") or s.has("num_attention_heads"):
            # NOTE: HF derives a missing head_dim; only a config without any size keeps the released 128.
            kw["head_dim"] = read_head_dim(
                s, kw.get("hidden_size", cls.hidden_size), kw.get("num_attention_heads", cls.num_attention_heads)
            )
        return cls(**kw)


@dataclasses.dataclass(frozen=True)
class ThinkerConfig:
    audio: AudioEncoderConfig = dataclasses.field(default_factory=AudioEncoderConfig)
    text: ThinkerTextConfig = dataclasses.field(default_factory=ThinkerTextConfig)
    vision: VisionEncoderConfig = dataclasses.field(default_factory=VisionEncoderConfig)
    audio_token_id: int = 151675
    audio_start_token_id: int = 151669
    audio_end_token_id: int = 151670
    image_token_id: int = 151655
    video_token_id: int = 151656
    vision_start_token_id: int = 151652
    vision_end_token_id: int = 151653
    user_token_id: int = 872
    position_id_per_seconds: int = 13  # only used by video positions, which this package does not build

    def __post_init__(self) -> None:
        if self.audio.output_dim != self.text.hidden_size:
            raise ValueError(
                f"ThinkerConfig.audio.output_dim={self.audio.output_dim} must equal "
                f"text.hidden_size={self.text.hidden_size} (audio features replace token embeddings)"
            )
        if self.vision.out_hidden_size != self.text.hidden_size:
            raise ValueError(
                f"ThinkerConfig.vision.out_hidden_size={self.vision.out_hidden_size} must equal "
                f"text.hidden_size={self.text.hidden_size} (image features replace token embeddings)"
            )
        if not 0 <= self.audio_token_id < self.text.vocab_size:
            raise ValueError(f"ThinkerConfig.audio_token_id={self.audio_token_id} is outside the vocabulary")

    @classmethod
    def from_hf_dict(cls, d: Mapping[str, Any] | HFSection) -> ThinkerConfig:
        s = as_section(d, "thinker_config")
        return cls(
            audio=AudioEncoderConfig.from_hf_dict(s.sub("audio_config")),
            text=ThinkerTextConfig.from_hf_dict(s.sub("text_config")),
            vision=VisionEncoderConfig.from_hf_dict(s.sub("vision_config")),
            **s.read_fields(cls, exclude=("audio", "text", "vision")),
        )
