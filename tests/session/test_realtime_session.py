"""The Realtime session: validation on construction, GA/beta normalisation and session.update's PATCH merge."""

from __future__ import annotations

import json
from typing import Any

import pytest

from voice_server.session.realtime import (
    DEFAULT_SESSION,
    AudioFormat,
    ServerVad,
    SessionConfig,
    SessionUpdate,
    parse_client_event,
)


def _patch(session: dict[str, Any]) -> dict[str, Any]:
    event = parse_client_event(json.dumps({"type": "session.update", "session": session}))
    assert isinstance(event, SessionUpdate), event
    return dict(event.patch)


def test_defaults() -> None:
    session = DEFAULT_SESSION
    assert session.is_audio_output and not session.is_manual_turns
    assert session.input_format == session.output_format == AudioFormat("audio/pcm")
    assert session.input_format.rate_hz == 24000
    assert session.turn_detection == ServerVad(0.5, 300, 500, True, True, None)
    ga = session.to_ga_dict()
    assert ga["type"] == "realtime" and ga["max_output_tokens"] == "inf"
    assert ga["audio"]["input"]["format"] == {"type": "audio/pcm", "rate": 24000}
    assert SessionConfig.from_ga_dict(ga) == session


def test_absent_keys_keep_their_values() -> None:
    session = DEFAULT_SESSION.updated(_patch({"instructions": "Speak French.", "voice": "cedar",
                                              "output_audio_format": "g711_ulaw"}))
    session = session.updated(_patch({"audio": {"input": {"turn_detection": {"type": "server_vad",
                                                                             "silence_duration_ms": 900}}}}))
    assert session.instructions == "Speak French." and session.voice == "cedar"
    assert session.output_format == AudioFormat("audio/pcmu")
    # NOTE: the nested object merges: threshold and padding keep their values, only silence changes.
    assert session.turn_detection == ServerVad(silence_duration_ms=900)
    session = session.updated(_patch({"turn_detection": {"type": "server_vad", "threshold": 0.8}}))
    assert session.turn_detection == ServerVad(threshold=0.8, silence_duration_ms=900)


def test_null_turns_detection_off_and_back_on_with_defaults() -> None:
    manual = DEFAULT_SESSION.updated(_patch({"turn_detection": {"type": "server_vad", "threshold": 0.9}}))
    manual = manual.updated(_patch({"audio": {"input": {"turn_detection": None}}}))
    assert manual.is_manual_turns and manual.to_ga_dict()["audio"]["input"]["turn_detection"] is None
    back = manual.updated(_patch({"turn_detection": {"type": "server_vad", "idle_timeout_ms": 6000}}))
    assert back.turn_detection == ServerVad(idle_timeout_ms=6000)


def test_format_change_replaces_the_whole_format() -> None:
    g711 = DEFAULT_SESSION.updated(_patch({"audio": {"input": {"format": {"type": "audio/pcma"}}}}))
    assert g711.input_format == AudioFormat("audio/pcma") and g711.input_format.rate_hz == 8000
    assert g711.to_ga_dict()["audio"]["input"]["format"] == {"type": "audio/pcma"}
    back = g711.updated(_patch({"audio": {"input": {"format": {"type": "audio/pcm", "rate": 24000}}}}))
    assert back.input_format == AudioFormat("audio/pcm")
    # A format without a type is audio/pcm, whatever the session had.
    assert g711.updated(_patch({"audio": {"input": {"format": {}}}})).input_format == AudioFormat("audio/pcm")


def test_ga_wins_over_beta_in_one_update() -> None:
    session = DEFAULT_SESSION.updated(_patch({"voice": "alloy", "audio": {"output": {"voice": "marin"}},
                                              "modalities": ["text"], "output_modalities": ["audio"]}))
    assert session.voice == "marin" and session.is_audio_output


def test_transcription_noise_reduction_temperature_and_tokens() -> None:
    session = DEFAULT_SESSION.updated(_patch({
        "input_audio_transcription": {"model": "whisper-1", "language": "en"},
        "input_audio_noise_reduction": {"type": "far_field"}, "temperature": 0.7,
        "max_response_output_tokens": 300}))
    assert session.transcription == {"model": "whisper-1", "language": "en"}
    assert session.noise_reduction == {"type": "far_field"}
    assert session.temperature == 0.7 and session.max_output_tokens == 300
    later = session.updated(_patch({"instructions": "x"}))
    assert later.temperature == 0.7, "a field not echoed by to_ga_dict must survive updates too"
    off = later.updated(_patch({"audio": {"input": {"transcription": None}}, "max_output_tokens": "inf"}))
    assert off.transcription is None and off.max_output_tokens is None and off.temperature == 0.7


def test_custom_voice_object_and_ignored_keys() -> None:
    session = DEFAULT_SESSION.updated(_patch({"type": "realtime", "model": "gpt-realtime", "tracing": "auto",
                                              "tool_choice": "auto", "tools": [],
                                              "audio": {"output": {"voice": {"id": "voice_1234"}}}}))
    assert session.voice == "voice_1234"


def test_echoing_session_created_back_is_a_valid_update() -> None:
    current = DEFAULT_SESSION.updated(_patch({"output_modalities": ["text"], "turn_detection": None}))
    assert current.updated(_patch(current.to_ga_dict())) == current


@pytest.mark.parametrize("kwargs", [
    {"output_modalities": ("audio", "text")}, {"output_modalities": ()}, {"voice": ""}, {"speed": 2.0},
    {"max_output_tokens": 0}, {"temperature": -1.0},
])
def test_session_config_validates_on_construction(kwargs: dict[str, Any]) -> None:
    with pytest.raises(ValueError):
        SessionConfig(**kwargs)


@pytest.mark.parametrize("kwargs", [{"threshold": 1.1}, {"prefix_padding_ms": -1}, {"idle_timeout_ms": 0}])
def test_server_vad_validates_on_construction(kwargs: dict[str, Any]) -> None:
    with pytest.raises(ValueError):
        ServerVad(**kwargs)


def test_audio_format_validates_on_construction() -> None:
    with pytest.raises(ValueError):
        AudioFormat("audio/opus")
