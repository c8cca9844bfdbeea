"""Noise reduction in the session configs: the core's field is validated and named in its error, each
protocol maps onto it (`/v1/realtime`'s `audio.input.noise_reduction` object, `/ws`'s `noise_reduction`
string), and `session.update` turning it on and off gives a session a suppressor or frees it."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from voice_server.config import pipeline_from_dict
from voice_server.session.config import SessionConfig
from voice_server.session.core import Session
from voice_server.session.native_messages import read_start
from voice_server.session.realtime import DEFAULT_SESSION
from voice_server.session.realtime.adapt import core_config
from voice_server.session.realtime.capabilities import IGNORED, SERVED
from voice_server.session.realtime.session_config import normalize_session_patch


@pytest.mark.parametrize("value", ["near_field", "far_field", None])
def test_the_core_takes_the_two_types_or_none(value: str | None) -> None:
    assert SessionConfig(noise_reduction=value).noise_reduction == value


@pytest.mark.parametrize("value", ["", "on", "NEAR_FIELD", 1, True, {"type": "near_field"}])
def test_anything_else_is_refused_naming_the_field(value: Any) -> None:
    with pytest.raises(ValueError, match="^noise_reduction: must be one of"):
        SessionConfig(noise_reduction=value)


def test_off_by_default_everywhere() -> None:
    assert SessionConfig().noise_reduction is None
    assert core_config(DEFAULT_SESSION).noise_reduction is None
    assert read_start({"type": "session.start"}).noise_reduction is None


@pytest.mark.parametrize("kind", ["near_field", "far_field"])
def test_realtime_object_maps_onto_the_core(kind: str) -> None:
    ga = DEFAULT_SESSION.updated(normalize_session_patch({"audio": {"input": {"noise_reduction": {"type": kind}}}}))
    beta = DEFAULT_SESSION.updated(normalize_session_patch({"input_audio_noise_reduction": {"type": kind}}))
    assert core_config(ga).noise_reduction == core_config(beta).noise_reduction == kind
    off = ga.updated(normalize_session_patch({"audio": {"input": {"noise_reduction": None}}}))
    assert core_config(off).noise_reduction is None


def test_realtime_says_it_serves_noise_reduction() -> None:
    assert any(name.startswith("session.audio.input.noise_reduction (") for name in SERVED)
    assert "session.audio.input.noise_reduction" not in IGNORED


def test_ws_session_start_maps_onto_the_core_and_names_a_bad_value() -> None:
    assert read_start({"type": "session.start", "noise_reduction": "far_field"}).noise_reduction == "far_field"
    assert read_start({"type": "session.start", "noise_reduction": None}).noise_reduction is None
    with pytest.raises(ValueError, match="^noise_reduction:"):
        read_start({"type": "session.start", "noise_reduction": {"type": "near_field"}})


def test_reconfigure_makes_and_frees_the_suppressor() -> None:
    class Unstarted:
        """A pipeline never started: the session submits nothing here, it only reads the config."""

        cfg = pipeline_from_dict({"name": "t", "stages": [{
            "name": "speech", "factory": "speech_stages:create_fake_speech", "scheduler": "ar", "terminal": True}]})

    async def scenario() -> None:
        session = Session(Unstarted(), SessionConfig(input_rate=16000), _discard)  # type: ignore[arg-type]
        assert session.denoiser is None
        await session.reconfigure(SessionConfig(input_rate=16000, noise_reduction="near_field"))
        first = session.denoiser
        assert first is not None and first.rate == 16000
        await session.reconfigure(SessionConfig(input_rate=16000, noise_reduction="far_field"))
        assert session.denoiser is first, "the same model: the stream goes on"
        await session.reconfigure(SessionConfig(input_rate=8000, noise_reduction="far_field"))
        assert first.is_closed and session.denoiser is not None and session.denoiser.rate == 8000
        second = session.denoiser
        await session.close()
        assert second.is_closed and session.denoiser is None

    asyncio.run(scenario())


async def _discard(event: object) -> None:
    pass
