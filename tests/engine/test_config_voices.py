"""A pipeline's `voices` and `default_voice` (`voice_server/config/voices.py`): what loads, what is refused and
how each refusal names its field, and the voices the shipped configs declare."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from voice_server.config import OPENAI_VOICES, ConfigError, PipelineConfig, StageConfig, VoiceConfig, load_pipeline
from voice_server.config import pipeline_from_dict as from_dict
from voice_server.config.voices import find_voice, merge_params

ECHO = "voice_server.stages.numeric:create_echo"
CONFIGS = Path(__file__).resolve().parents[2] / "configs"
TWO = {"ethan": {"params": {"talker": {"speaker": "ethan"}}, "openai": ["alloy", "ash"]},
       "chelsie": {"params": {"talker": {"speaker": "chelsie"}}, "openai": ["coral"]}}


def solo(**pipeline: Any) -> dict[str, Any]:
    return {"name": "t", "stages": [{"name": "solo", "factory": ECHO, "terminal": True}], **pipeline}


def test_voices_load_in_order_and_names_choose_them_in_any_case() -> None:
    cfg = from_dict(solo(voices=TWO))
    assert [v.name for v in cfg.voices] == ["ethan", "chelsie"]
    assert cfg.voices[0] == VoiceConfig("ethan", {"talker": {"speaker": "ethan"}}, ("alloy", "ash"))
    assert cfg.default_voice_config is cfg.voices[0]
    assert find_voice(cfg.voices, "CORAL") is cfg.voices[1] and find_voice(cfg.voices, "Chelsie") is cfg.voices[1]
    assert find_voice(cfg.voices, "sage") is None
    assert cfg.voices[1].param_paths == frozenset({"talker.speaker"})
    assert cfg.voices[0].describe() == "ethan (alloy, ash)"
    assert from_dict(solo(voices=TWO, default_voice="chelsie")).default_voice_config == cfg.voices[1]


def test_a_pipeline_without_voices_has_none() -> None:
    for cfg in (from_dict(solo()), from_dict(solo(voices=None))):
        assert cfg.voices == () and cfg.default_voice_config is None


def test_a_voice_with_nothing_but_its_name_is_a_voice_of_no_params() -> None:
    cfg = from_dict(solo(voices={"heart": None, "other": {"openai": ["echo"]}}))
    assert cfg.voices == (VoiceConfig("heart"), VoiceConfig("other", {}, ("echo",)))


def test_the_openai_names_are_the_sdks() -> None:
    from typing import get_args

    from openai.types.realtime.realtime_audio_config_output import Voice

    literals = [get_args(arg) for arg in get_args(Voice) if get_args(arg)]
    assert [set(names) for names in literals] == [set(OPENAI_VOICES)]


@pytest.mark.parametrize(("voices", "extra", "field", "needle"), [
    ([], {}, "voices", "must be a mapping of voice name"),
    ({"x": []}, {}, "voices.x", "must be a mapping with params and openai"),
    ({"x": {"colour": "red"}}, {}, "voices.x.colour", "unknown field (known: params, openai)"),
    ({"x": {"params": [1]}}, {}, "voices.x.params", "must be a mapping of request params"),
    ({"x": {"params": {"talker": {"speaker": {1, 2}}}}}, {}, "voices.x.params.talker.speaker", "JSON-like"),
    ({"x": {"openai": "alloy"}}, {}, "voices.x.openai", "must be a list of OpenAI voice names"),
    ({"x": {"openai": ["alloy", "nova"]}}, {}, "voices.x.openai", "'nova' is not an OpenAI voice; those are alloy"),
    ({"x": {"openai": ["echo", "echo"]}}, {}, "voices.x.openai", "names a voice twice"),
    ({"bad name": {}}, {}, "voices.bad name.name", "must be 1-64 letters"),
    ({"x": {"openai": ["echo"]}, "y": {"openai": ["echo"]}}, {}, "voices.y", "'echo' already chooses voice 'x'"),
    ({"x": {"openai": ["echo"]}, "Echo": {}}, {}, "voices.Echo", "'Echo' already chooses voice 'x'"),
    ({"x": {"params": {"talker": {"speaker": "a"}}}, "y": {"params": {}}}, {}, "voices.y.params",
     "sets none, but voice 'x' sets talker.speaker: every voice must set the same params"),
    (TWO, {"default_voice": "nobody"}, "default_voice", "'nobody' is not a declared voice (ethan, chelsie)"),
    ({}, {"default_voice": "heart"}, "default_voice", "'heart' is not a declared voice (none are declared)"),
    (TWO, {"default_voice": 3}, "default_voice", "must be a string"),
])
def test_bad_voices_are_refused_naming_the_field(voices: Any, extra: dict[str, Any], field: str, needle: str) -> None:
    with pytest.raises(ConfigError) as info:
        from_dict(solo(voices=voices, **extra))
    assert str(info.value).startswith(f"pipeline 't': field '{field}': ") and needle in str(info.value), info.value


def test_a_voice_built_in_code_is_checked_too() -> None:
    with pytest.raises(ConfigError, match=r"voice 'x': field 'openai': 'nova' is not an OpenAI voice"):
        VoiceConfig("x", {}, ("nova",))
    with pytest.raises(ConfigError, match=r"pipeline 't': field 'voices': must be a tuple of VoiceConfig"):
        PipelineConfig("t", (StageConfig("solo", ECHO, terminal=True),), voices=[VoiceConfig("x")])  # type: ignore[arg-type]
    many = tuple(VoiceConfig(f"v{i}") for i in range(65))
    with pytest.raises(ConfigError, match=r"field 'voices': 65 voices is more than the 64"):
        PipelineConfig("t", (StageConfig("solo", ECHO, terminal=True),), voices=many)


def test_params_merge_key_by_key() -> None:
    base = {"sampling": {"max_tokens": 5}, "talker": {"speaker": "ethan", "max_frames": 9}}
    assert merge_params(base, {"talker": {"speaker": "chelsie"}}) == {
        "sampling": {"max_tokens": 5}, "talker": {"speaker": "chelsie", "max_frames": 9}}
    assert base["talker"]["speaker"] == "ethan"  # NOTE: not changed in place


@pytest.mark.parametrize(("name", "voices", "params"), [
    ("default.yaml", ["heart"], [{}]),
    ("default-whisper.yaml", ["heart"], [{}]),
    ("default-piper.yaml", ["en_US-joe-medium"], [{}]),
    ("qwen3-omni-tiny.yaml", ["ethan", "chelsie"], [{"talker": {"speaker": s}} for s in ("ethan", "chelsie")]),
    ("qwen3-omni-30b-a3b.yaml", ["ethan", "chelsie", "aiden"],
     [{"talker": {"speaker": s}} for s in ("ethan", "chelsie", "aiden")]),
    ("qwen3-omni-30b-a3b-2gpu.yaml", ["ethan", "chelsie", "aiden"],
     [{"talker": {"speaker": s}} for s in ("ethan", "chelsie", "aiden")]),
])
def test_the_shipped_configs_declare_their_voices_and_map_every_openai_name(
        name: str, voices: list[str], params: list[dict[str, Any]]) -> None:
    cfg = load_pipeline(CONFIGS / name)
    assert [v.name for v in cfg.voices] == voices and [v.params for v in cfg.voices] == params
    assert sorted(n for v in cfg.voices for n in v.openai) == sorted(OPENAI_VOICES)
    assert cfg.default_voice_config is cfg.voices[0]
