"""A pipeline's voices: what a session may ask a response to speak in (`voices` and `default_voice` of a config).

In YAML, `voices` maps a voice's name to what choosing it means:

    voices:
      chelsie:
        params: {talker: {speaker: chelsie}}   # request params of every request of a response in this voice
        openai: [coral, sage, shimmer, marin]  # OpenAI voice names that choose it too
    default_voice: chelsie                     # optional: the first voice declared

Rules (each a `ConfigError` naming `voices.<name>.<field>`, or `voices` / `default_voice`):
- a name is 1-64 letters, digits, `_`, `.`, `-`, starting with a letter or digit; names and the OpenAI names
  of all voices are distinct, case-insensitively (a session's name must choose one voice);
- `openai` lists names of `OPENAI_VOICES`: a misspelt one would never be chosen;
- `params` is a JSON-like mapping, and every voice sets the same params (the same leaf paths, e.g. all
  `talker.speaker`): a response in another voice then replaces the session's voice whole, never keeping
  part of it;
- at most `MAX_VOICES` voices.

A pipeline that declares no voices takes any voice name as metadata (echoed, changing nothing).
"""

from __future__ import annotations

import copy
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from voice_server.config.errors import ConfigError, fail, quoted, show

OPENAI_VOICES = ("alloy", "ash", "ballad", "coral", "echo", "sage", "shimmer", "verse", "marin", "cedar")
"""OpenAI Realtime's voice names (the `openai` SDK's literals for `audio.output.voice`)."""
MAX_VOICES = 64
MAX_PARAMS_DEPTH = 8
VOICE_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")
_KNOWN = ("params", "openai")


@dataclass(frozen=True)
class VoiceConfig:
    name: str
    params: dict[str, Any] = field(default_factory=dict)
    """Request params merged into every request of a response in this voice ({} for a one-voice engine)."""
    openai: tuple[str, ...] = ()
    """OpenAI voice names that choose this voice."""

    def __post_init__(self) -> None:
        where = f"voice {quoted(self.name)}"
        if not isinstance(self.name, str) or not VOICE_NAME_RE.match(self.name):
            raise fail(where, "name", f"must be 1-64 letters, digits, '_', '.', '-', starting with a letter or "
                       f"digit, got {show(self.name)}")
        if not isinstance(self.params, dict):
            raise fail(where, "params", f"must be a mapping of request params, got {show(self.params)}")
        _check_json(where, "params", self.params, 0)
        if not isinstance(self.openai, tuple) or not all(isinstance(n, str) for n in self.openai):
            raise fail(where, "openai", f"must be a list of OpenAI voice names, got {show(self.openai)}")
        for name in self.openai:
            if name not in OPENAI_VOICES:
                raise fail(where, "openai", f"{quoted(name)} is not an OpenAI voice; those are "
                           f"{', '.join(OPENAI_VOICES)}")
        if len(set(self.openai)) != len(self.openai):
            raise fail(where, "openai", "names a voice twice")

    @property
    def names(self) -> tuple[str, ...]:
        """Every name that chooses this voice: its own, then its OpenAI names."""
        return (self.name, *(n for n in self.openai if n.lower() != self.name.lower()))

    @property
    def param_paths(self) -> frozenset[str]:
        """The dotted paths of the leaves `params` sets (`talker.speaker`)."""
        return frozenset(_leaf_paths(self.params, ""))

    def describe(self) -> str:
        """`chelsie (coral, sage)`: for messages that list the voices."""
        others = self.names[1:]
        return f"{self.name} ({', '.join(others)})" if others else self.name


def _check_json(where: str, path: str, value: object, depth: int) -> None:
    if depth > MAX_PARAMS_DEPTH:
        raise fail(where, path, f"nested deeper than {MAX_PARAMS_DEPTH} levels")
    if isinstance(value, dict):
        for key, item in value.items():
            if not isinstance(key, str) or not key:
                raise fail(where, path, f"keys must be non-empty strings, got {show(key)}")
            _check_json(where, f"{path}.{key}", item, depth + 1)
    elif isinstance(value, list):
        for index, item in enumerate(value):
            _check_json(where, f"{path}[{index}]", item, depth + 1)
    elif value is not None and not isinstance(value, (str, int, float, bool)):
        raise fail(where, path, f"must be JSON-like (mappings, lists, strings, numbers), got {show(value)}")


def _leaf_paths(params: Mapping[str, Any], prefix: str) -> list[str]:
    paths = []
    for key, value in params.items():
        path = f"{prefix}{key}"
        paths.extend(_leaf_paths(value, path + ".") if isinstance(value, dict) and value else [path])
    return paths


def voices_from_dict(where: str, raw: object) -> tuple[VoiceConfig, ...]:
    """YAML's `voices` mapping (name -> {params, openai}) as VoiceConfigs, in the order written."""
    if raw is None:
        return ()
    if not isinstance(raw, dict):
        raise fail(where, "voices", f"must be a mapping of voice name -> {{params, openai}}, got {show(raw)}")
    voices = []
    for name, spec in raw.items():
        spec = {} if spec is None else spec
        if not isinstance(spec, dict):
            raise fail(where, f"voices.{name}", f"must be a mapping with {' and '.join(_KNOWN)}, got {show(spec)}")
        unknown = sorted(str(k) for k in spec if k not in _KNOWN)
        if unknown:
            raise fail(where, f"voices.{name}.{unknown[0]}", f"unknown field (known: {', '.join(_KNOWN)})")
        openai = spec.get("openai") or []
        try:
            voices.append(VoiceConfig(name, {} if spec.get("params") is None else spec["params"],
                                      tuple(openai) if isinstance(openai, list) else openai))
        except ConfigError as exc:
            # NOTE: said from the pipeline, with the field's YAML path: `voices.chelsie.openai`.
            raise ConfigError(f"{where}: {_as_field_of(str(exc), name)}") from exc
    return tuple(voices)


def _as_field_of(message: str, name: object) -> str:
    prefix = f"voice {quoted(name)}: field '"
    return message.replace(prefix, f"field 'voices.{name}.", 1) if message.startswith(prefix) else message


def check_voices(where: str, voices: object, default_voice: str) -> None:
    """The voices of one pipeline: distinct names, the same params paths, a declared default."""
    if not isinstance(voices, tuple) or not all(isinstance(v, VoiceConfig) for v in voices):
        raise fail(where, "voices", "must be a tuple of VoiceConfig")
    if len(voices) > MAX_VOICES:
        raise fail(where, "voices", f"{len(voices)} voices is more than the {MAX_VOICES} a pipeline may declare")
    owner: dict[str, int] = {}
    for index, voice in enumerate(voices):
        for name in voice.names:
            first = owner.setdefault(name.lower(), index)
            if first != index:
                raise fail(where, f"voices.{voice.name}", f"{quoted(name)} already chooses voice "
                           f"{quoted(voices[first].name)}: a name must choose one voice")
    if voices:
        paths = voices[0].param_paths
        for voice in voices[1:]:
            if voice.param_paths != paths:
                raise fail(where, f"voices.{voice.name}.params",
                           f"sets {_paths(voice.param_paths)}, but voice {quoted(voices[0].name)} sets "
                           f"{_paths(paths)}: every voice must set the same params, so that choosing one "
                           "replaces another whole")
    if default_voice and find_voice(voices, default_voice) is None:
        have = ", ".join(v.name for v in voices) if voices else "none are declared"
        raise fail(where, "default_voice", f"{quoted(default_voice)} is not a declared voice ({have})")


def _paths(paths: frozenset[str]) -> str:
    return ", ".join(sorted(paths)) if paths else "none"


def find_voice(voices: tuple[VoiceConfig, ...], name: str) -> VoiceConfig | None:
    """The voice `name` chooses (its own name or one of its OpenAI names, any case), or None."""
    key = name.lower()
    return next((v for v in voices if any(n.lower() == key for n in v.names)), None)


def merge_params(base: Mapping[str, Any], overlay: Mapping[str, Any]) -> dict[str, Any]:
    """`base` with `overlay` merged in: mappings key by key, anything else replaced (by a copy: a request's params
    never share an object with the config's)."""
    merged = dict(base)
    for key, value in overlay.items():
        current = merged.get(key)
        merged[key] = merge_params(current, value) if isinstance(current, dict) and isinstance(value, dict) \
            else copy.deepcopy(value)
    return merged
