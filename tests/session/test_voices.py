"""A session's voice, below the sockets: a name resolved against the pipeline's voices, and the request params it
puts into a Realtime session's config, a response's overrides and a `/ws` `session.start`'s config (the
endpoints end to end: tests/server/test_voices.py)."""

from __future__ import annotations

import re
from typing import Any

import pytest

from voice_server.config import pipeline_from_dict
from voice_server.session.native_messages import read_start
from voice_server.session.realtime import DEFAULT_SESSION
from voice_server.session.realtime.adapt import core_config
from voice_server.session.realtime.capabilities import capabilities
from voice_server.session.realtime.errors import INVALID_VALUE, FieldError
from voice_server.session.voices import UnknownVoice, choose_voice, voice_overrides

CFG = pipeline_from_dict({
    "name": "t", "stages": [{"name": "solo", "factory": "voice_server.stages.numeric:create_echo", "terminal": True}],
    "voices": {"ethan": {"params": {"talker": {"speaker": "ethan"}}, "openai": ["alloy", "ash"]},
               "chelsie": {"params": {"talker": {"speaker": "chelsie"}}, "openai": ["coral"]}},
})
VOICES = CFG.voices
LISTED = "ethan (alloy, ash), chelsie (coral)"


def session_with(voice: Any) -> Any:
    return DEFAULT_SESSION.updated({"audio": {"output": {"voice": voice}}, "max_output_tokens": 9})


def test_a_realtime_voice_puts_its_params_beside_the_sampling() -> None:
    assert dict(core_config(session_with("coral"), VOICES).params) == {
        "sampling": {"max_tokens": 9}, "talker": {"speaker": "chelsie"}}
    assert dict(core_config(session_with("Ethan"), VOICES).params)["talker"] == {"speaker": "ethan"}
    assert dict(core_config(session_with({"id": "ash"}), VOICES).params)["talker"] == {"speaker": "ethan"}


def test_an_unknown_realtime_voice_is_invalid_value_listing_the_voices() -> None:
    with pytest.raises(FieldError) as info:
        core_config(session_with("shimmer"), VOICES)
    assert (info.value.code, info.value.param) == (INVALID_VALUE, "session.audio.output.voice")
    assert info.value.message == ("Invalid value for 'session.audio.output.voice': Unknown voice 'shimmer'; this "
                                  f"server's voices are {LISTED}.")


def test_without_voices_any_name_is_metadata() -> None:
    assert choose_voice((), "anything") is None
    assert dict(core_config(session_with("shimmer")).params) == {"sampling": {"max_tokens": 9}}
    assert "voices" not in capabilities() and "session.audio.output.voice" in capabilities()["ignored"]


def test_with_voices_the_capabilities_serve_the_voice_and_list_them() -> None:
    caps = capabilities(VOICES, CFG.default_voice_config)
    assert "session.audio.output.voice" in caps["served"] and "session.audio.output.voice" not in caps["ignored"]
    assert caps["voices"] == [{"name": "ethan", "openai": ["alloy", "ash"], "is_default": True},
                              {"name": "chelsie", "openai": ["coral"], "is_default": False}]


def test_a_responses_voice_replaces_the_sessions_keeping_the_rest() -> None:
    session_params = {"sampling": {"max_tokens": 9}, "talker": {"speaker": "ethan", "max_frames": 40}}
    chelsie = choose_voice(VOICES, "coral")
    assert chelsie is not None
    assert voice_overrides(session_params, chelsie) == {"talker": {"speaker": "chelsie", "max_frames": 40}}
    with pytest.raises(UnknownVoice, match=re.escape(f"Unknown voice 'nova'; this server's voices are {LISTED}.")):
        choose_voice(VOICES, "nova")


def start(**fields: Any) -> dict[str, Any]:
    config = read_start({"type": "session.start", **fields}, "server_vad", VOICES, CFG.default_voice_config)
    return dict(config.params)


def test_ws_session_start_takes_a_voice_or_the_default() -> None:
    assert start() == {"talker": {"speaker": "ethan"}}
    assert start(voice="coral", params={"sampling": {"max_tokens": 3}, "talker": {"max_frames": 7}}) == {
        "sampling": {"max_tokens": 3}, "talker": {"max_frames": 7, "speaker": "chelsie"}}
    # NOTE: without voices, `voice` is metadata and params pass as given
    assert dict(read_start({"type": "session.start", "voice": "any", "params": {"talker": {"speaker": "x"}}}).params) \
        == {"talker": {"speaker": "x"}}


@pytest.mark.parametrize(("fields", "needle"), [
    ({"voice": "nova"}, f"voice: Unknown voice 'nova'; this server's voices are {LISTED}."),
    ({"voice": ""}, "voice: must be a non-empty string"),
    ({"voice": 3}, "voice: must be a non-empty string"),
    ({"params": {"talker": {"speaker": "chelsie"}}},
     "params.talker.speaker: set by the voice; choose one with `voice`"),
    ({"params": {"talker": "chelsie"}}, "params.talker.speaker: set by the voice"),
])
def test_ws_session_start_refuses_a_bad_voice_naming_the_field(fields: dict[str, Any], needle: str) -> None:
    with pytest.raises(ValueError) as info:
        start(**fields)
    assert str(info.value).startswith(needle), info.value
