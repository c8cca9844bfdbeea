"""Whole-model Qwen3-Omni config: thinker + talker + code2wav + chat/tts token ids, from config.json.

Missing fields take the RELEASED Qwen3-Omni-30B-A3B values (never transformers' class defaults, which
do not match the release). The thinker and code2wav sub-configs default to the release by themselves;
the talker config reads every value from its dict, so the released talker block is merged under it here.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from voice_server.models.hf_config import HFSection
from voice_server.models.qwen3_omni.code2wav.config import Code2WavConfig
from voice_server.models.qwen3_omni.talker.config import TalkerConfig
from voice_server.models.qwen3_omni.thinker.config import ThinkerConfig

# The released `talker_config` block (sizes and ids); the given dict overrides it key by key.
RELEASED_TALKER_CONFIG: dict[str, Any] = {
    "accept_hidden_layer": 24, "num_code_groups": 16, "thinker_hidden_size": 2048,
    "codec_pad_id": 2148, "codec_bos_id": 2149, "codec_eos_token_id": 2150,
    "codec_nothink_id": 2155, "codec_think_bos_id": 2156, "codec_think_eos_id": 2157,
    "speaker_id": {"chelsie": 2301, "ethan": 2302, "aiden": 2303},
    "audio_token_id": 151675, "image_token_id": 151655, "video_token_id": 151656,
    "audio_start_token_id": 151669, "vision_start_token_id": 151652, "position_id_per_seconds": 13,
    "text_config": {
        "vocab_size": 3072, "hidden_size": 1024, "intermediate_size": 2048, "num_hidden_layers": 20,
        "num_attention_heads": 16, "num_key_value_heads": 2, "head_dim": 128, "moe_intermediate_size": 384,
        "num_experts": 128, "num_experts_per_tok": 6, "shared_expert_intermediate_size": 768,
        "norm_topk_prob": True, "rms_norm_eps": 1e-6, "hidden_act": "silu", "rope_theta": 1e6,
        "rope_scaling": {"mrope_section": [24, 20, 20], "interleaved": True, "rope_type": "default"},
    },
    "code_predictor_config": {
        "vocab_size": 2048, "hidden_size": 1024, "intermediate_size": 3072, "num_hidden_layers": 5,
        "num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 128, "num_code_groups": 16,
        "rms_norm_eps": 1e-6, "rope_theta": 1e6,
    },
}

# Keys that name the same thing; a given alias must displace the released default of the other.
_ALIASES = {"num_local_experts": "num_experts", "rope_parameters": "rope_scaling"}


def _merge_under(released: dict[str, Any], given: dict[str, Any]) -> dict[str, Any]:
    merged = {k: v for k, v in released.items() if not any(a in given and n == k for a, n in _ALIASES.items())}
    for key, value in given.items():
        if value is None:
            continue
        if key in ("text_config", "code_predictor_config") and isinstance(value, dict):
            merged[key] = _merge_under(released.get(key, {}), value)
        else:
            merged[key] = value
    return merged


@dataclass(frozen=True)
class Qwen3OmniConfig:
    thinker: ThinkerConfig = field(default_factory=ThinkerConfig)
    talker: TalkerConfig = field(default_factory=lambda: TalkerConfig.from_hf_dict(RELEASED_TALKER_CONFIG))
    code2wav: Code2WavConfig = field(default_factory=Code2WavConfig)
    enable_audio_output: bool = True
    im_start_token_id: int = 151644
    im_end_token_id: int = 151645
    system_token_id: int = 8948
    user_token_id: int = 872
    assistant_token_id: int = 77091
    tts_pad_token_id: int = 151671
    tts_bos_token_id: int = 151672
    tts_eos_token_id: int = 151673

    def __post_init__(self) -> None:
        vocab = self.thinker.text.vocab_size
        for name in ("im_start_token_id", "im_end_token_id", "system_token_id", "user_token_id",
                     "assistant_token_id", "tts_pad_token_id", "tts_bos_token_id", "tts_eos_token_id"):
            value = getattr(self, name)
            if not 0 <= value < vocab:
                raise ValueError(f"Qwen3OmniConfig.{name}={value} is outside the thinker vocabulary ({vocab})")
        if self.talker.thinker_hidden_size != self.thinker.text.hidden_size:
            raise ValueError(
                f"Qwen3OmniConfig.talker.thinker_hidden_size={self.talker.thinker_hidden_size} differs from "
                f"thinker.text.hidden_size={self.thinker.text.hidden_size}"
            )
        if not 0 <= self.talker.accept_hidden_layer <= self.thinker.text.num_hidden_layers:
            raise ValueError(
                f"Qwen3OmniConfig.talker.accept_hidden_layer={self.talker.accept_hidden_layer} is outside "
                f"[0, thinker num_hidden_layers={self.thinker.text.num_hidden_layers}]"
            )
        if self.code2wav.num_quantizers != self.talker.num_code_groups:
            raise ValueError(
                f"Qwen3OmniConfig.code2wav.num_quantizers={self.code2wav.num_quantizers} differs from "
                f"talker.num_code_groups={self.talker.num_code_groups}"
            )

    @classmethod
    def from_hf_dict(cls, d: dict[str, Any], where: str = "config.json") -> Qwen3OmniConfig:
        """`d` is the checkpoint's config.json (model_type qwen3_omni_moe); `where` names it in errors."""
        s = HFSection(d, where)
        s.read_str("model_type", "qwen3_omni_moe", choices=("qwen3_omni_moe",))
        talker = s.sub("talker_config")
        return cls(
            thinker=ThinkerConfig.from_hf_dict(s.sub("thinker_config")),
            talker=TalkerConfig.from_hf_dict(
                HFSection(_merge_under(RELEASED_TALKER_CONFIG, dict(talker.d)), talker.file, talker.path)
            ),
            code2wav=Code2WavConfig.from_hf_dict(s.sub("code2wav_config")),
            **s.read_fields(cls, exclude=("thinker", "talker", "code2wav")),
        )

    @classmethod
    def from_json_file(cls, path: str | Path) -> Qwen3OmniConfig:
        """Read a checkpoint folder's config.json (or the file itself)."""
        path = Path(path)
        if path.is_dir():
            path = path / "config.json"
        return cls.from_hf_dict(json.loads(path.read_text()), str(path))
