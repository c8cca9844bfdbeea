"""Talker and code-predictor (MTP) configs, read from the checkpoint's `talker_config` dict."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

# NOTE: the transformers config classes carry defaults that do not match the released model
# (e.g. num_code_groups 32 vs 16, codec ids 4196.. vs 2148..), so every value is read from the dict.


def _rope_params(d: dict[str, Any]) -> dict[str, Any]:
    # transformers 5.x writes `rope_parameters`; released config.json files use `rope_scaling` + `rope_theta`.
    rope = dict(d.get("rope_parameters") or d.get("rope_scaling") or {})
    rope.setdefault("rope_theta", d.get("rope_theta", 10000.0))
    return rope


def _mrope_section(rope: dict[str, Any]) -> tuple[int, int, int]:
    section = [int(x) for x in rope.get("mrope_section", (24, 20, 20))]
    if len(section) != 3:
        raise ValueError(f"TalkerConfig.mrope_section must have 3 entries (t, h, w), got {section}")
    return (section[0], section[1], section[2])


def _check_positive(obj: object, names: tuple[str, ...]) -> None:
    for name in names:
        value = getattr(obj, name)
        if value <= 0:
            raise ValueError(f"{type(obj).__name__}.{name} must be positive, got {value}")


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
        _check_positive(self, ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                               "num_attention_heads", "num_key_value_heads", "head_dim"))
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
    def from_hf_dict(cls, d: dict[str, Any]) -> CodePredictorConfig:
        heads = int(d["num_attention_heads"])
        return cls(
            vocab_size=int(d["vocab_size"]),
            hidden_size=int(d["hidden_size"]),
            intermediate_size=int(d["intermediate_size"]),
            num_hidden_layers=int(d["num_hidden_layers"]),
            num_attention_heads=heads,
            num_key_value_heads=int(d.get("num_key_value_heads") or heads),
            head_dim=int(d.get("head_dim") or d["hidden_size"] // heads),
            num_code_groups=int(d["num_code_groups"]),
            rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
            rope_theta=float(_rope_params(d)["rope_theta"]),
            hidden_act=str(d.get("hidden_act", "silu")),
            sliding_window=d.get("sliding_window"),
            layer_types=tuple(d.get("layer_types") or ()),
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

    def __post_init__(self) -> None:
        _check_positive(self, ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                               "num_attention_heads", "num_key_value_heads", "head_dim",
                               "moe_intermediate_size", "num_experts", "num_experts_per_tok",
                               "shared_expert_intermediate_size", "thinker_hidden_size"))
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
    def from_hf_dict(cls, d: dict[str, Any]) -> TalkerConfig:
        """`d` is the checkpoint's `talker_config` dict (with `text_config`, `code_predictor_config`)."""
        text = d["text_config"]
        heads = int(text["num_attention_heads"])
        rope = _rope_params(text)
        num_experts = text.get("num_experts", text.get("num_local_experts"))
        return cls(
            vocab_size=int(text["vocab_size"]),
            hidden_size=int(text["hidden_size"]),
            intermediate_size=int(text["intermediate_size"]),
            num_hidden_layers=int(text["num_hidden_layers"]),
            num_attention_heads=heads,
            num_key_value_heads=int(text.get("num_key_value_heads") or heads),
            head_dim=int(text.get("head_dim") or text["hidden_size"] // heads),
            moe_intermediate_size=int(text["moe_intermediate_size"]),
            num_experts=int(num_experts),
            num_experts_per_tok=int(text["num_experts_per_tok"]),
            shared_expert_intermediate_size=int(text["shared_expert_intermediate_size"]),
            thinker_hidden_size=int(d["thinker_hidden_size"]),
            num_code_groups=int(d["num_code_groups"]),
            accept_hidden_layer=int(d["accept_hidden_layer"]),
            codec_eos_token_id=int(d["codec_eos_token_id"]),
            codec_pad_id=int(d["codec_pad_id"]),
            codec_bos_id=int(d["codec_bos_id"]),
            codec_nothink_id=int(d["codec_nothink_id"]),
            codec_think_bos_id=int(d["codec_think_bos_id"]),
            codec_think_eos_id=int(d["codec_think_eos_id"]),
            code_predictor=CodePredictorConfig.from_hf_dict(d["code_predictor_config"]),
            # NOTE: the HF class default is False, but the released config sets it; read, never assume.
            is_norm_topk_prob=bool(text.get("norm_topk_prob", False)),
            rms_norm_eps=float(text.get("rms_norm_eps", 1e-6)),
            rope_theta=float(rope["rope_theta"]),
            mrope_section=_mrope_section(rope),
            hidden_act=str(text.get("hidden_act", "silu")),
            speaker_ids=tuple(sorted((str(k).lower(), int(v)) for k, v in (d.get("speaker_id") or {}).items())),
            audio_token_id=int(d.get("audio_token_id", 151646)),
            image_token_id=int(d.get("image_token_id", 151655)),
            video_token_id=int(d.get("video_token_id", 151656)),
        )
