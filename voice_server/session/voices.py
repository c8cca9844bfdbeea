"""A session's voice: the name a client gives (`/v1/realtime` `audio.output.voice` or `response.create`'s, `/ws`
`session.start` `voice`) resolved against the pipeline's voices (`voice_server/config/voices.py`), and the
request params it puts into each response.

With no voices declared, any name is metadata (echoed, changing nothing), as before pipelines had voices.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from voice_server.config.voices import VoiceConfig, find_voice, merge_params

MAX_NAME_CHARS = 256


class UnknownVoice(ValueError):
    """A voice name the pipeline does not declare; the message lists those it does."""


def choose_voice(voices: tuple[VoiceConfig, ...], name: str) -> VoiceConfig | None:
    """The voice `name` chooses; None when the pipeline declares none; UnknownVoice otherwise."""
    if not voices:
        return None
    voice = find_voice(voices, name)
    if voice is None:
        raise UnknownVoice(f"Unknown voice {name!r}; this server's voices are {available(voices)}.")
    return voice


def named_voice(name: object, voices: tuple[VoiceConfig, ...],
                default: VoiceConfig | None) -> tuple[str | None, VoiceConfig | None]:
    """`/ws` `session.start`'s `voice` (`default` when absent): the name, and the voice it chooses (None where
    the pipeline declares none: the name is metadata); ValueError naming `voice` and listing the voices."""
    if name is None:
        return (None if default is None else default.name), default
    if not isinstance(name, str) or not name or len(name) > MAX_NAME_CHARS:
        raise ValueError(f"voice: must be a non-empty string of at most {MAX_NAME_CHARS} characters")
    try:
        return name, choose_voice(voices, name)
    except UnknownVoice as exc:
        raise ValueError(f"voice: {exc}") from exc


def check_unset(params: Mapping[str, Any], voice: VoiceConfig, voices: tuple[VoiceConfig, ...]) -> None:
    """ValueError when `params` set what the voice sets (or a value on its way: `{"talker": 1}`)."""
    for path in sorted(voice.param_paths):
        if _sets(params, path.split(".")):
            raise ValueError(f"params.{path}: set by the voice; choose one with `voice` ({available(voices)})")


def _sets(value: object, keys: list[str]) -> bool:
    if not keys:
        return True
    if not isinstance(value, Mapping):
        return True  # NOTE: a value where the voice's path goes on: the voice would replace it
    return keys[0] in value and _sets(value[keys[0]], keys[1:])


def available(voices: tuple[VoiceConfig, ...]) -> str:
    """`ethan (alloy, ash), chelsie (coral)`: each voice and, in brackets, the OpenAI names that choose it."""
    return ", ".join(voice.describe() for voice in voices)


def with_voice(params: Mapping[str, Any], voice: VoiceConfig | None) -> dict[str, Any]:
    """`params` with the voice's params merged over them."""
    return merge_params(params, voice.params) if voice is not None else dict(params)


def voice_overrides(session_params: Mapping[str, Any], voice: VoiceConfig) -> dict[str, Any]:
    """What one response in `voice` sends over the session's params: the top-level keys the voice sets, each the
    session's value with the voice merged in.

    NOTE: the session merges a response's params over its own one top-level key at a time; every voice of a
    pipeline sets the same paths (`check_voices`), so this replaces the session's voice whole."""
    merged = with_voice(session_params, voice)
    return {key: merged[key] for key in voice.params}


def voices_info(voices: tuple[VoiceConfig, ...], default: VoiceConfig | None) -> list[dict[str, Any]]:
    """The voices as a client is told them (`session.created`, `/ws` `session.started`)."""
    return [{"name": v.name, "openai": list(v.openai), "is_default": v is default} for v in voices]
