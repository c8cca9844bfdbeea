"""The Realtime endpoint's pure parts: the session config mapped onto the core's, audio in and out, the pace
guard on appended audio, and the subprotocol a browser gets back."""

from __future__ import annotations

import numpy as np
import pytest

from voice_server.session.realtime import DEFAULT_SESSION
from voice_server.session.realtime.adapt import INPUT_BURST_MS, InputPace, core_config, decode_input, encode_output
from voice_server.session.realtime.endpoint import choose_subprotocol
from voice_server.session.realtime.session_fields import AudioFormat


def test_the_default_session_is_pcm_24k_with_server_vad_and_no_sampling_params() -> None:
    core = core_config(DEFAULT_SESSION)
    assert (core.input_rate, core.output_rate, core.params) == (24000, 24000, ())
    assert core.turn_detection is not None and core.turn_detection.silence_duration_ms == 500


def test_g711_manual_turns_and_sampling_map_onto_the_core() -> None:
    session = DEFAULT_SESSION.updated({"audio": {"input": {"format": {"type": "audio/pcmu"}, "turn_detection": None},
                                                 "output": {"format": {"type": "audio/pcma"}, "voice": "marin"}},
                                       "instructions": "Be kind.", "max_output_tokens": 64, "temperature": 0.7})
    core = core_config(session)
    assert (core.input_rate, core.output_rate, core.turn_detection, core.instructions) == (8000, 8000, None, "Be kind.")
    assert dict(core.params) == {"sampling": {"max_tokens": 64, "temperature": 0.7}}


def test_a_turn_detection_past_the_servers_bounds_is_refused() -> None:
    session = DEFAULT_SESSION.updated({"audio": {"input": {"turn_detection": {"type": "server_vad",
                                                                               "prefix_padding_ms": 8000}}}})
    with pytest.raises(ValueError, match="prefix_padding_ms"):
        core_config(session)


@pytest.mark.parametrize("fmt", ["audio/pcm", "audio/pcmu", "audio/pcma"])
def test_audio_round_trips_through_each_format(fmt: str) -> None:
    pcm = (8000 * np.sin(np.arange(800) / 7)).astype(np.int16)
    decoded = decode_input(encode_output(pcm, AudioFormat(fmt)), AudioFormat(fmt))
    assert decoded.dtype == np.int16 and decoded.size == pcm.size
    assert np.abs(decoded.astype(int) - pcm).max() <= (0 if fmt == "audio/pcm" else 256)  # G.711 is lossy


def test_pcm_of_an_odd_number_of_bytes_is_refused() -> None:
    with pytest.raises(ValueError):
        decode_input(b"\x01\x02\x03", AudioFormat())


def test_the_pace_guard_allows_2x_real_time_plus_a_burst() -> None:
    now = [100.0]
    pace = InputPace(clock=lambda: now[0])
    assert pace.admit(INPUT_BURST_MS) and not pace.admit(20)
    now[0] += 1.0  # one second later: two seconds more may come, not more
    assert pace.admit(1500) and pace.admit(500) and not pace.admit(20)
    assert pace.num_ms == INPUT_BURST_MS + 2000, "refused audio is not counted"


@pytest.mark.parametrize(("offered", "chosen"), [
    (["realtime", "openai-insecure-api-key.sk-1", "openai-beta.realtime-v1"], "realtime"),
    (["openai-insecure-api-key.sk-1", "openai-beta.realtime-v1"], "openai-beta.realtime-v1"),
    (["openai-insecure-api-key.sk-1"], None), ([], None)])
def test_the_subprotocol_echoed_is_never_the_key(offered: list[str], chosen: str | None) -> None:
    assert choose_subprotocol(offered) == chosen
