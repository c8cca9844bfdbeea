"""The shared config.json reader (voice_server/models/hf_config.py) and the model configs built on it."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from voice_server.models.hf_config import HFConfigError, HFSection, check_positive, read_head_dim, read_rope
from voice_server.models.llama import LlamaConfig
from voice_server.models.qwen3_omni.code2wav.config import Code2WavConfig
from voice_server.models.qwen3_omni.config import Qwen3OmniConfig
from voice_server.models.qwen3_omni.presets import tiny_config_dict
from voice_server.models.qwen3_omni.talker.config import TalkerConfig
from voice_server.models.qwen3_omni.thinker.config import ThinkerTextConfig

LLAMA = {
    "model_type": "llama", "vocab_size": 64, "hidden_size": 32, "intermediate_size": 48,
    "num_hidden_layers": 2, "num_attention_heads": 4,
}


def test_required_field_missing_or_null_names_section_and_field() -> None:
    section = HFSection({"a": None}, "ckpt/config.json", "talker_config.text_config")
    with pytest.raises(HFConfigError, match=r"^ckpt/config\.json talker_config\.text_config: b is required$"):
        section.read_int("b")
    with pytest.raises(HFConfigError, match=r"a is required \(null given\)"):
        section.read_int("a")
    with pytest.raises(ValueError, match="config.json: vocab_size is required"):
        LlamaConfig.from_hf_dict({k: v for k, v in LLAMA.items() if k != "vocab_size"})
    tiny = tiny_config_dict()
    del tiny["talker_config"]["code_predictor_config"]["num_code_groups"]
    with pytest.raises(ValueError, match=r"talker_config\.code_predictor_config: num_code_groups is required"):
        TalkerConfig.from_hf_dict(tiny["talker_config"])


def test_defaulted_field_missing_or_null_takes_the_default() -> None:
    section = HFSection({"a": None})
    assert section.read_int("a", 7) == 7 and section.read_int("b", 8) == 8
    assert section.read_opt_int("a") is None and not section.has("a")
    assert section.sub("missing").read_float("x", 1.5) == 1.5
    assert LlamaConfig.from_hf_dict({**LLAMA, "num_key_value_heads": None}).num_key_value_heads == 4


@pytest.mark.parametrize(
    ("value", "reader", "expected"),
    [
        ("32", "read_int", "hidden_size must be an int, got str '32'"),
        (True, "read_int", "hidden_size must be an int, got bool True"),
        (32.0, "read_int", "hidden_size must be an int, got float 32.0"),
        ("1e-6", "read_float", "hidden_size must be a number, got str"),
        (1, "read_bool", "hidden_size must be true or false, got int 1"),
        (3, "read_str", "hidden_size must be a string, got int 3"),
        ([1, "2"], "read_int_tuple", "hidden_size must be a list of ints"),
    ],
)
def test_wrong_type_is_an_error_naming_the_field(value: object, reader: str, expected: str) -> None:
    with pytest.raises(HFConfigError, match=f"^config.json text_config: {expected}"):
        getattr(HFSection({"hidden_size": value}, path="text_config"), reader)("hidden_size")


def test_wrong_type_in_model_configs() -> None:
    with pytest.raises(ValueError, match=r"config.json: hidden_size must be an int, got str '32'"):
        LlamaConfig.from_hf_dict({**LLAMA, "hidden_size": "32"})
    with pytest.raises(ValueError, match=r"thinker_config\.text_config: mlp_only_layers must be a list of ints"):
        Qwen3OmniConfig.from_hf_dict({"thinker_config": {"text_config": {"mlp_only_layers": "0"}}})
    with pytest.raises(ValueError, match=r"code2wav_config: upsample_rates must be a list of ints"):
        Code2WavConfig.from_hf_dict({"upsample_rates": [8, 5.5]})
    with pytest.raises(ValueError, match=r"talker_config: speaker_id must be an object of ints"):
        Qwen3OmniConfig.from_hf_dict({"talker_config": {"speaker_id": {"ethan": "2302"}}})


def test_section_errors_name_the_file(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"code2wav_config": {"sliding_window": "72"}}))
    with pytest.raises(ValueError, match=rf"{tmp_path / 'config.json'} code2wav_config: sliding_window must be"):
        Qwen3OmniConfig.from_json_file(tmp_path)
    with pytest.raises(HFConfigError, match="config.json thinker_config: expected an object, got list"):
        Qwen3OmniConfig.from_hf_dict({"thinker_config": [1]})


@pytest.mark.parametrize("head_dim", ["missing", None])
def test_null_or_missing_head_dim_falls_back_to_hidden_over_heads(head_dim: object) -> None:
    d = dict(LLAMA) if head_dim == "missing" else {**LLAMA, "head_dim": head_dim}
    assert read_head_dim(HFSection(d), 32, 4) == 8
    assert LlamaConfig.from_hf_dict(d).head_dim == 8
    tiny = tiny_config_dict()["talker_config"]
    tiny["text_config"]["head_dim"] = None
    tiny["code_predictor_config"]["head_dim"] = None
    cfg = TalkerConfig.from_hf_dict(tiny)
    text, mtp = tiny["text_config"], tiny["code_predictor_config"]
    assert cfg.head_dim == text["hidden_size"] // text["num_attention_heads"]
    assert cfg.code_predictor.head_dim == mtp["hidden_size"] // mtp["num_attention_heads"]
    text_cfg = ThinkerTextConfig.from_hf_dict({"hidden_size": 64, "num_attention_heads": 4, "head_dim": None,
                                               "rope_parameters": {"mrope_section": [4, 2, 2]}})
    assert text_cfg.head_dim == 16
    assert read_head_dim(HFSection({"head_dim": 12}), 32, 4) == 12


def test_both_rope_spellings_read_the_same() -> None:
    llama3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
              "original_max_position_embeddings": 64}
    old = {**LLAMA, "rope_theta": 5e5, "rope_scaling": llama3}
    new = {**LLAMA, "rope_parameters": {**llama3, "rope_theta": 5e5}}
    legacy_type_key = {**LLAMA, "rope_theta": 5e5, "rope_scaling": {**llama3, "type": "llama3"}}
    del legacy_type_key["rope_scaling"]["rope_type"]
    configs = [LlamaConfig.from_hf_dict(d) for d in (old, new, legacy_type_key)]
    assert configs[0] == configs[1] == configs[2]
    assert (configs[0].rope_theta, configs[0].rope_type, configs[0].rope_factor) == (5e5, "llama3", 8.0)
    assert configs[0].rope_original_max_position_embeddings == 64
    # Defaults: no rope keys at all; a theta inside the dict wins over a top-level one.
    plain = read_rope(HFSection({}), 1e4)
    assert (plain.theta, plain.rope_type, plain.mrope_section) == (1e4, "default", None)
    both = read_rope(HFSection({"rope_theta": 1.0, "rope_parameters": {"rope_theta": 2.0}}), 1e4)
    assert both.theta == 2.0
    # M-RoPE sections (thinker and talker) in either spelling.
    sections = {"mrope_section": [4, 2, 2], "interleaved": True, "rope_type": "default"}
    for text in ({"rope_theta": 5e5, "rope_scaling": sections}, {"rope_parameters": {**sections, "rope_theta": 5e5}}):
        cfg = ThinkerTextConfig.from_hf_dict({"head_dim": 16, **text})
        assert (cfg.rope_theta, cfg.mrope_section) == (5e5, (4, 2, 2))


def test_unsupported_rope_type_names_the_field() -> None:
    with pytest.raises(HFConfigError, match=r"config.json rope_scaling: rope_type 'yarn' is not supported"):
        LlamaConfig.from_hf_dict({**LLAMA, "rope_scaling": {"rope_type": "yarn", "factor": 2.0}})
    with pytest.raises(HFConfigError, match=r"code2wav_config\.rope_parameters: rope_type 'llama3' is not supported"):
        Code2WavConfig.from_hf_dict({"rope_parameters": {"rope_type": "llama3"}})


@pytest.mark.parametrize(
    ("build", "message"),
    [
        (lambda: LlamaConfig.from_hf_dict({**LLAMA, "hidden_size": 0}), "config.json: hidden_size must be > 0, got 0"),
        (lambda: LlamaConfig.from_hf_dict({**LLAMA, "head_dim": 0}), "config.json: head_dim must be > 0, got 0"),
        (lambda: LlamaConfig.from_hf_dict({**LLAMA, "num_key_value_heads": -2}), "num_key_value_heads must be > 0"),
        (lambda: LlamaConfig.from_hf_dict({**LLAMA, "rope_theta": 0}), "config.json: rope_theta must be > 0"),
        (lambda: LlamaConfig.from_hf_dict({**LLAMA, "rms_norm_eps": -1e-6}), "rms_norm_eps must be > 0"),
        (lambda: ThinkerTextConfig.from_hf_dict({"rope_parameters": {"rope_theta": -1.0}}), "rope_theta must be > 0"),
        (lambda: TalkerConfig.from_hf_dict({**tiny_config_dict()["talker_config"], "thinker_hidden_size": 0}),
         r"talker_config: thinker_hidden_size must be > 0"),
        (lambda: Code2WavConfig.from_hf_dict({"decoder_dim": 0}), "Code2WavConfig.decoder_dim must be > 0"),
    ],
)
def test_non_positive_values_are_rejected_with_the_field_name(build: object, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        build()  # type: ignore[operator]


def test_check_positive_on_built_configs() -> None:
    @dataclasses.dataclass
    class Sizes:
        n: object = 1

    check_positive(Sizes(2.5), "n")
    for bad in (0, -1, None, True, "3"):
        with pytest.raises(ValueError, match=r"Sizes\.n must be > 0"):
            check_positive(Sizes(bad), "n")
    with pytest.raises(ValueError, match=r"Sizes\.n must be a positive int, got 2.5"):
        check_positive(Sizes(2.5), "n", integer=True)
