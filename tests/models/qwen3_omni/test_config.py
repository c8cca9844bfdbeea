"""Qwen3-Omni config parsing: released defaults, legacy and transformers-5 rope formats, tiny preset."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from voice_server.models.qwen3_omni.config import Qwen3OmniConfig
from voice_server.models.qwen3_omni.presets import TINY_IDS, tiny_config_dict
from voice_server.models.qwen3_omni.thinker.config import AudioEncoderConfig, ThinkerConfig, ThinkerTextConfig

# A trimmed copy of the released config.json (transformers 4.x format: rope_scaling + top-level rope_theta).
RELEASED_EXCERPT = {
    "model_type": "qwen3_omni_moe",
    "im_start_token_id": 151644, "im_end_token_id": 151645, "assistant_token_id": 77091,
    "system_token_id": 8948, "user_token_id": 872, "enable_audio_output": True,
    "tts_bos_token_id": 151672, "tts_eos_token_id": 151673, "tts_pad_token_id": 151671,
    "thinker_config": {
        "audio_start_token_id": 151669, "audio_end_token_id": 151670, "audio_token_id": 151675,
        "position_id_per_seconds": 13, "user_token_id": 872,
        "audio_config": {
            "num_mel_bins": 128, "d_model": 1280, "encoder_attention_heads": 20, "encoder_ffn_dim": 5120,
            "encoder_layers": 32, "downsample_hidden_size": 480, "output_dim": 2048, "n_window": 50,
            "n_window_infer": 800,
        },
        "text_config": {
            "num_hidden_layers": 48, "hidden_size": 2048, "num_attention_heads": 32, "num_key_value_heads": 4,
            "head_dim": 128, "moe_intermediate_size": 768, "num_experts": 128, "num_experts_per_tok": 8,
            "norm_topk_prob": True, "vocab_size": 152064, "rope_theta": 1000000, "mlp_only_layers": [],
            "rope_scaling": {"mrope_section": [24, 20, 20], "interleaved": True, "rope_type": "default"},
        },
    },
    "talker_config": {
        "accept_hidden_layer": 24, "num_code_groups": 16, "thinker_hidden_size": 2048,
        "speaker_id": {"chelsie": 2301, "ethan": 2302, "aiden": 2303},
        "text_config": {"num_experts": 128, "num_experts_per_tok": 6, "shared_expert_intermediate_size": 768},
    },
    "code2wav_config": {"num_quantizers": 16, "codebook_size": 2048, "sliding_window": 72},
}


def _assert_released(cfg: Qwen3OmniConfig) -> None:
    th = cfg.thinker
    assert th.text.vocab_size == 152064 and th.text.num_hidden_layers == 48 and th.text.head_dim == 128
    assert th.text.mrope_section == (24, 20, 20) and th.text.rope_theta == 1e6
    assert th.text.num_experts_per_tok == 8 and th.text.mlp_only_layers == ()
    assert th.audio.output_dim == 2048 and th.audio.n_window_infer == 800
    assert th.position_id_per_seconds == 13 and th.audio_token_id == 151675
    tk = cfg.talker
    assert tk.num_code_groups == 16 and tk.accept_hidden_layer == 24 and tk.num_experts_per_tok == 6
    assert (tk.codec_pad_id, tk.codec_bos_id, tk.codec_eos_token_id) == (2148, 2149, 2150)
    assert tk.speaker_token_id("Ethan") == 2302
    assert cfg.code2wav.num_quantizers == 16 and cfg.code2wav.total_upsample == 1920
    assert cfg.tts_pad_token_id == 151671 and cfg.assistant_token_id == 77091


def test_defaults_and_empty_dict_are_the_release() -> None:
    _assert_released(Qwen3OmniConfig())
    _assert_released(Qwen3OmniConfig.from_hf_dict({}))


def test_released_legacy_format_parses(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps(RELEASED_EXCERPT))
    cfg = Qwen3OmniConfig.from_json_file(tmp_path)
    _assert_released(cfg)
    assert cfg == Qwen3OmniConfig()


def test_release_differs_from_transformers_class_defaults() -> None:
    import transformers

    hf = transformers.Qwen3OmniMoeThinkerConfig()
    ours = ThinkerConfig.from_hf_dict({})
    assert hf.position_id_per_seconds == 25 and ours.position_id_per_seconds == 13
    assert hf.audio_config.output_dim == 3584 and ours.audio.output_dim == 2048


def test_tiny_preset_parses_like_transformers() -> None:
    import transformers

    d = tiny_config_dict()
    hf = transformers.Qwen3OmniMoeConfig(**d)
    cfg = Qwen3OmniConfig.from_hf_dict(d)
    # The config transformers writes with save_pretrained parses to the same thing (the MTP's
    # `layer_types` only gets spelled out, all full attention).
    saved = Qwen3OmniConfig.from_hf_dict(json.loads(hf.to_json_string()))
    same_mtp = dataclasses.replace(saved.talker.code_predictor, layer_types=())
    assert dataclasses.replace(saved, talker=dataclasses.replace(saved.talker, code_predictor=same_mtp)) == cfg
    htext, text = hf.thinker_config.text_config, cfg.thinker.text
    assert (text.hidden_size, text.num_hidden_layers, text.head_dim) == (htext.hidden_size, 2, htext.head_dim)
    assert list(text.mrope_section) == htext.rope_parameters["mrope_section"]
    assert text.rope_theta == htext.rope_parameters["rope_theta"]
    assert (text.num_experts, text.num_experts_per_tok) == (htext.num_experts, htext.num_experts_per_tok)
    haudio, audio = hf.thinker_config.audio_config, cfg.thinker.audio
    assert (audio.d_model, audio.num_mel_bins, audio.n_window_infer) == (
        haudio.d_model, haudio.num_mel_bins, haudio.n_window_infer,
    )
    assert cfg.thinker.audio_token_id == hf.thinker_config.audio_token_id == TINY_IDS["audio"]
    assert cfg.talker.accept_hidden_layer == hf.talker_config.accept_hidden_layer == 1
    assert cfg.talker.num_code_groups == cfg.code2wav.num_quantizers == 4
    assert cfg.talker.speaker_token_id("ethan") == hf.talker_config.speaker_id["ethan"]
    assert cfg.tts_eos_token_id == hf.tts_eos_token_id


def test_rope_parameters_format_overrides_released_rope_scaling() -> None:
    d = {"text_config": {"head_dim": 16, "rope_parameters": {"rope_theta": 5e5, "mrope_section": [4, 2, 2]}}}
    text = ThinkerConfig.from_hf_dict({**d, "audio_config": {"output_dim": 2048}}).text
    assert text.rope_theta == 5e5 and text.mrope_section == (4, 2, 2)


def test_missing_head_dim_is_derived_like_transformers() -> None:
    assert ThinkerTextConfig.from_hf_dict({"hidden_size": 64, "num_attention_heads": 4,
                                           "rope_parameters": {"mrope_section": [4, 2, 2]}}).head_dim == 16
    assert ThinkerTextConfig.from_hf_dict({}).head_dim == 128


@pytest.mark.parametrize(
    ("build", "field_name"),
    [
        (lambda: ThinkerTextConfig(mrope_section=(24, 20, 19)), "mrope_section"),
        (lambda: ThinkerTextConfig(num_key_value_heads=5), "num_attention_heads"),
        (lambda: ThinkerTextConfig(num_hidden_layers=0), "num_hidden_layers"),
        (lambda: AudioEncoderConfig(n_window_infer=150), "n_window_infer"),
        (lambda: ThinkerConfig(audio=AudioEncoderConfig(output_dim=64)), "output_dim"),
        (lambda: ThinkerTextConfig.from_hf_dict({"rope_scaling": {"rope_type": "yarn"}}), "rope_type"),
        (lambda: Qwen3OmniConfig.from_hf_dict({"model_type": "qwen2_5_omni"}), "model_type"),
        (lambda: Qwen3OmniConfig.from_hf_dict({"tts_pad_token_id": 10**7}), "tts_pad_token_id"),
    ],
)
def test_invalid_values_name_the_field(build: object, field_name: str) -> None:
    with pytest.raises(ValueError, match=field_name):
        build()  # type: ignore[operator]
