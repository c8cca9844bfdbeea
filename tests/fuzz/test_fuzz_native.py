"""Fuzz: the native ``/ws`` ``session.start`` reader and ``TurnDetectionConfig`` raise only ValueError.

``read_start`` documents "ValueError naming the field"; the endpoint closes 1008 with it. The control
messages after the start are fuzzed end to end in ``tests/server/test_fuzz_server.py`` (they act on a
live session).
"""

from __future__ import annotations

import json

from fuzz_values import FUZZ, json_values, numbers, objects, scalars, shaped
from hypothesis import example, given
from hypothesis import strategies as st

from voice_server.session.config import SessionConfig
from voice_server.session.native_messages import read_start
from voice_server.session.turn_config import TurnDetectionConfig

VAD_KEYS = ["type", "threshold", "prefix_padding_ms", "silence_duration_ms", "create_response",
            "interrupt_response", "idle_timeout_ms"]
WORDS = [*VAD_KEYS, "session.start", "server_vad", "input_rate", "output_rate", "instructions", "turn_detection",
         "params", "sampling", "max_tokens", "8000", "16000", "24000", "48000"]
NUMBERS = numbers()
VAD_FIELDS = {key: st.one_of(NUMBERS, scalars(WORDS)) for key in VAD_KEYS[1:]}
VADS = st.one_of(shaped(VAD_FIELDS, WORDS, {"type": st.sampled_from(["server_vad", "semantic_vad", ""])}),
                 shaped({"type": scalars(WORDS), **VAD_FIELDS}, WORDS), json_values(WORDS))
STARTS = st.one_of(
    st.fixed_dictionaries({"type": st.just("session.start")}, optional={
        "input_rate": NUMBERS, "output_rate": NUMBERS, "instructions": scalars(WORDS),
        "turn_detection": st.one_of(st.none(), VADS), "params": json_values(WORDS),
        "noise_reduction": st.one_of(st.sampled_from([None, "near_field", "far_field"]), json_values(WORDS))}),
    objects(WORDS, {"type": st.just("session.start")}), json_values(WORDS))


@FUZZ
@given(STARTS)
@example({"type": "session.start", "turn_detection": {"threshold": 10**400}})  # was an OverflowError
def test_session_start_is_a_config_or_a_value_error(message: object) -> None:
    # NOTE: through JSON, as the endpoint reads it (NaN and Infinity included).
    message = json.loads(json.dumps(message))
    try:
        config = read_start(message)
    except ValueError as exc:
        assert str(exc)
        return
    assert isinstance(config, SessionConfig)


@FUZZ
@given(VADS)
@example({"type": "server_vad", "threshold": -(10**400)})  # was an OverflowError
def test_turn_detection_is_a_config_or_a_value_error(raw: object) -> None:
    try:
        config = TurnDetectionConfig.from_openai(raw)  # type: ignore[arg-type]
    except ValueError as exc:
        assert str(exc).startswith("turn_detection")
        return
    assert 0.0 <= config.threshold <= 1.0
