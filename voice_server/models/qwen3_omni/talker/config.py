"""Talker and code-predictor (MTP) configs, read from the checkpoint's `talker_config` dict."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from voice_server.models.hf_config import HFSection, as_section, check_positive, read_head_dim, read_rope

# NOTE: the transformers config classes carry defaults that do not match the released model
# (e.g. num_code_groups 32 vs 16, codec ids 4196.. vs 2148..), so every size and id is a required
# field here (`Qwen3OmniConfig` merges the released talker block under the given one).


def _check_act(obj: object, hidden_act: str) -> None:
    if hidden_act != "silu":
        raise ValueError(f"{type(obj).__name__}.hidden_act={hidden_act!r} is not supported (only 'silu')")


@dataclass(frozen=True)
class CodePredictorConfig:
    """The dense 5-layer MTP that fills codebooks 1..num_code_groups-1 of one frame."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    num_code_groups: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    hidden_act: str = "silu"
    # NOTE: a frame is at most num_code_groups positions long, so a window only matters if smaller.
    sliding_window: int | None = None
    layer_types: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        check_positive(self, "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                       "num_attention_heads", "num_key_value_heads", "head_dim")
        _check_act(self, self.hidden_act)
        if self.num_code_groups < 2:
            raise ValueError(f"CodePredictorConfig.num_code_groups must be >= 2, got {self.num_code_groups}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError("CodePredictorConfig.num_attention_heads must be a multiple of num_key_value_heads")
        if self.layer_types and len(self.layer_types) != self.num_hidden_layers:
            raise ValueError("CodePredictorConfig.layer_types must have num_hidden_layers entries")

    def layer_window(self, layer_idx: int) -> int | None:
        if self.layer_types and self.layer_types[layer_idx] == "sliding_attention":
            return self.sliding_window
        return None

    @classmethod
    def from_hf_dict(cls, d: Mapping[str, Any] | HFSection) -> CodePredictorConfig:
        s = as_section(d, "talker_config.code_predictor_config")
        hidden_size = s.read_int("hidden_size", positive=True)
        heads = s.read_int("num_attention_heads", positive=True)
        return cls(
            vocab_size=s.read_int("vocab_size", positive=True),
            hidden_size=hidden_size,
            intermediate_size=s.read_int("intermediate_size", positive=True),
            num_hidden_layers=s.read_int("num_hidden_layers", positive=True),
            num_attention_heads=heads,
            num_key_value_heads=s.read_int("num_key_value_heads", heads, positive=True),
            head_dim=read_head_dim(s, hidden_size, heads),
            num_code_groups=s.read_int("num_code_groups"),
            rms_norm_eps=s.read_float("rms_norm_eps", 1e-6),
            rope_theta=read_rope(s, 10000.0).theta,
            hidden_act=s.read_str("hidden_act", "silu"),
            sliding_window=s.read_opt_int("sliding_window"),
            layer_types=s.read_str_tuple("layer_types", ()),
        )


@dataclass(frozen=True)
class TalkerConfig:
    """The MoE talker decoder (codebook 0) plus its projections, codec ids and the MTP config."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int  # NOTE: also the inner width of text_projection / hidden_projection
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    moe_intermediate_size: int
    num_experts: int
    num_experts_per_tok: int
    shared_expert_intermediate_size: int
    thinker_hidden_size: int
    num_code_groups: int
    accept_hidden_layer: int
    codec_eos_token_id: int
    codec_pad_id: int
    codec_bos_id: int
    codec_nothink_id: int
    codec_think_bos_id: int
    codec_think_eos_id: int
    code_predictor: CodePredictorConfig
    is_norm_topk_prob: bool = True
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1e6
    mrope_section: tuple[int, int, int] = (24, 20, 20)
    hidden_act: str = "silu"
    speaker_ids: tuple[tuple[str, int], ...] = field(default_factory=tuple)
    audio_token_id: int = 151646
    image_token_id: int = 151655
    video_token_id: int = 151656
    max_position_embeddings: int = 65536

    def __post_init__(self) -> None:
        check_positive(self, "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                       "num_attention_heads", "num_key_value_heads", "head_dim", "moe_intermediate_size",
                       "num_experts", "num_experts_per_tok", "shared_expert_intermediate_size",
                       "thinker_hidden_size", "max_position_embeddings")
        _check_act(self, self.hidden_act)
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError("TalkerConfig.num_attention_heads must be a multiple of num_key_value_heads")
        if self.num_experts_per_tok > self.num_experts:
            raise ValueError("TalkerConfig.num_experts_per_tok must be <= num_experts")
        if self.num_code_groups != self.code_predictor.num_code_groups:
            raise ValueError(
                f"TalkerConfig.num_code_groups={self.num_code_groups} differs from "
                f"code_predictor.num_code_groups={self.code_predictor.num_code_groups}"
            )
        if self.code_predictor.hidden_size != self.hidden_size:
            raise ValueError("TalkerConfig.code_predictor.hidden_size must equal hidden_size")
        if len(self.mrope_section) != 3 or 2 * sum(self.mrope_section) > self.head_dim:
            raise ValueError(f"TalkerConfig.mrope_section={self.mrope_section} does not fit head_dim")
        # NOTE: generation suppresses [vocab - 1024, vocab) except EOS, so control ids must live there.
        if self.vocab_size < 1024 + self.code_predictor.vocab_size:
            raise ValueError("TalkerConfig.vocab_size must be >= 1024 + code_predictor.vocab_size")
        if not 0 <= self.codec_eos_token_id < self.vocab_size:
            raise ValueError(f"TalkerConfig.codec_eos_token_id={self.codec_eos_token_id} is out of range")

    def speaker_token_id(self, speaker: str) -> int:
        for name, token_id in self.speaker_ids:
            if name == speaker.lower():
                return token_id
        raise ValueError(f"unknown speaker {speaker!r}; known: {[n for n, _ in self.speaker_ids]}")

    @classmethod
    def from_hf_dict(cls, d: Mapping[str, Any] | HFSection) -> TalkerConfig:
        """`d` is the checkpoint's `talker_config` dict (with `text_config`, `code_predictor_config`)."""
        s = as_section(d, "talker_config")
        if not s.has("text_config"):
            raise s.error("text_config", "is required")
        text = s.sub("text_config")
        hidden_size = text.read_int("hidden_size", positive=True)
        heads = text.read_int("num_attention_heads", positive=True)
        rope = read_rope(text, 10000.0, rope_types=("default", "mrope"))
        if not s.has("code_predictor_config"):
            raise s.error("code_predictor_config", "is required")
        return cls(
            vocab_size=text.read_int("vocab_size", positive=True),
            hidden_size=hidden_size,
            intermediate_size=text.read_int("intermediate_size", positive=True),
            num_hidden_layers=text.read_int("num_hidden_layers", positive=True),
            num_attention_heads=heads,
            num_key_value_heads=text.read_int("num_key_value_heads", heads, positive=True),
            head_dim=read_head_dim(text, hidden_size, heads),
            moe_intermediate_size=text.read_int("moe_intermediate_size", positive=True),
            num_experts=text.read_int("num_experts", positive=True, aliases=("num_local_experts",)),
            num_experts_per_tok=text.read_int("num_experts_per_tok", positive=True),
            shared_expert_intermediate_size=text.read_int("shared_expert_intermediate_size", positive=True),
            thinker_hidden_size=s.read_int("thinker_hidden_size", positive=True),
            num_code_groups=s.read_int("num_code_groups"),
            accept_hidden_layer=s.read_int("accept_hidden_layer"),
            codec_eos_token_id=s.read_int("codec_eos_token_id"),
            codec_pad_id=s.read_int("codec_pad_id"),
            codec_bos_id=s.read_int("codec_bos_id"),
            codec_nothink_id=s.read_int("codec_nothink_id"),
            codec_think_bos_id=s.read_int("codec_think_bos_id"),
            codec_think_eos_id=s.read_int("codec_think_eos_id"),
            code_predictor=CodePredictorConfig.from_hf_dict(s.sub("code_predictor_config")),
            # NOTE: the HF class default is False, but the released config sets it; read, never assume.
            is_norm_topk_prob=text.read_bool("norm_topk_prob", False),
            rms_norm_eps=text.read_float("rms_norm_eps", 1e-6),
            rope_theta=rope.theta,
            mrope_section=_mrope_section(rope.params),
            hidden_act=text.read_str("hidden_act", "silu"),
            speaker_ids=tuple(sorted((k.lower(), v) for k, v in s.read_int_map("speaker_id", {}).items())),
            audio_token_id=s.read_int("audio_token_id", 151646),
            image_token_id=s.read_int("image_token_id", 151655),
            video_token_id=s.read_int("video_token_id", 151656),
            max_position_embeddings=text.read_int("max_position_embeddings", 65536, positive=True),
        )


def _mrope_section(rope_params: HFSection) -> tuple[int, int, int]:
    a, b, c = rope_params.read_int_tuple("mrope_section", (24, 20, 20), length=3)
    return (a, b, c)
