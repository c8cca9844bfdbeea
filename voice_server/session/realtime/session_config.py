"""The Realtime session configuration: one internal form for the GA and the beta ``session`` shapes.

``session.update`` carries a partial session. ``normalize_session_patch`` validates it and rewrites it
to the GA shape (beta keys moved to their GA place), and ``SessionConfig.updated(patch)`` merges it into
the current session with PATCH semantics:

- a key absent from the patch keeps its current value; ``null`` sets it to null (``turn_detection:
  null`` is manual turn-taking, ``transcription: null`` turns transcription off);
- nested objects merge key by key, unless their ``type`` changes (a new audio format or turn
  detection kind replaces the old object whole, so no stale ``rate`` or ``threshold`` survives);
- arrays replace.

Beta to GA: ``modalities`` -> ``output_modalities`` (in either form a list holding ``audio`` means
audio, as audio output always carries its transcript); ``input_audio_format`` and
``output_audio_format`` (``pcm16|g711_ulaw|g711_alaw``) -> ``audio.{input,output}.format``;
``turn_detection``, ``input_audio_transcription``, ``input_audio_noise_reduction`` -> ``audio.input.*``;
``voice``, ``speed`` -> ``audio.output.*``; ``max_response_output_tokens`` -> ``max_output_tokens``.
When both forms of a field come in one update the GA one wins.

Decisions:

- ``semantic_vad`` runs the pipeline's end-of-turn model with its ``eagerness``
  (``voice_server/session/semantic_vad.py``).
- ``temperature`` (beta only, gone from GA) is kept for the sampler but not echoed by ``to_ga_dict``.
- ``tools`` (``function`` tools) and ``tool_choice`` are served (`tool_fields.py`); prompt templates are not:
  ``prompt`` must be null.
- ``parallel_tool_calls`` (a response may make several calls either way), ``model``, ``tracing``,
  ``truncation``, ``include``, ``reasoning`` and the read-only fields a client may echo back from
  ``session.created`` are accepted and ignored.
- ``session.type`` may be left out (beta clients never send it); when present it must be ``realtime``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from voice_server.session.realtime.errors import (
    UNSUPPORTED,
    FieldError,
    as_choice,
    as_float,
    as_object,
    as_str,
    check_keys,
    join,
    require,
)
from voice_server.session.realtime.session_fields import (
    MAX_OUTPUT_TOKENS_LIMIT,
    MODALITIES,
    AudioFormat,
    ServerVad,
    check_unserved,
    parse_audio_format,
    parse_beta_format,
    parse_max_output_tokens,
    parse_modalities,
    parse_noise_reduction,
    parse_transcription,
    parse_turn_detection,
    parse_voice,
)
from voice_server.session.realtime.tool_fields import (
    check_choice,
    parse_tool_choice,
    parse_tools,
    tool_choice_to_ga,
    tool_to_ga,
)
from voice_server.session.tools import Tool

DEFAULT_VOICE = "alloy"

_IGNORED_KEYS = frozenset({"model", "tracing", "truncation", "include", "parallel_tool_calls",
                           "object", "id", "expires_at", "client_secret", "reasoning"})
_GA_KEYS = frozenset({"type", "output_modalities", "instructions", "audio", "max_output_tokens", "temperature",
                      "tools", "tool_choice", "prompt"})
_BETA_KEYS = {"modalities": ("output_modalities",), "input_audio_format": ("audio", "input", "format"),
              "output_audio_format": ("audio", "output", "format"),
              "turn_detection": ("audio", "input", "turn_detection"),
              "input_audio_transcription": ("audio", "input", "transcription"),
              "input_audio_noise_reduction": ("audio", "input", "noise_reduction"),
              "voice": ("audio", "output", "voice"), "speed": ("audio", "output", "speed"),
              "max_response_output_tokens": ("max_output_tokens",)}


@dataclass(frozen=True)
class SessionConfig:
    """The whole session as this server runs it; build one from a GA dict with ``from_ga_dict``."""

    output_modalities: tuple[str, ...] = ("audio",)
    instructions: str = ""
    input_format: AudioFormat = field(default_factory=AudioFormat)
    output_format: AudioFormat = field(default_factory=AudioFormat)
    turn_detection: ServerVad | None = field(default_factory=ServerVad)
    # NOTE: kept as the validated GA dicts and echoed (clients check them). Noise reduction runs on the input
    # (`adapt.core_config`); transcription is the pipeline's own recogniser's, whatever this says.
    transcription: Mapping[str, Any] | None = None
    noise_reduction: Mapping[str, Any] | None = None
    voice: str = DEFAULT_VOICE
    speed: float = 1.0
    max_output_tokens: int | None = None  # None is "inf"
    temperature: float | None = None
    tools: tuple[Tool, ...] = ()
    tool_choice: str = "auto"
    """`auto`, `none`, `required` or the name of one of `tools`."""

    def __post_init__(self) -> None:
        if len(self.output_modalities) != 1 or self.output_modalities[0] not in MODALITIES:
            raise ValueError(f"output_modalities must be ('audio',) or ('text',), got {self.output_modalities}")
        if not self.voice:
            raise ValueError("voice must not be empty")
        if not 0.25 <= self.speed <= 1.5:
            raise ValueError(f"speed must be in [0.25, 1.5], got {self.speed}")
        if self.max_output_tokens is not None and not 1 <= self.max_output_tokens <= MAX_OUTPUT_TOKENS_LIMIT:
            raise ValueError(f"max_output_tokens must be in [1, {MAX_OUTPUT_TOKENS_LIMIT}], got "
                             f"{self.max_output_tokens}")
        if self.temperature is not None and not 0.0 <= self.temperature <= 2.0:
            raise ValueError(f"temperature must be in [0, 2], got {self.temperature}")

    @property
    def is_audio_output(self) -> bool:
        return self.output_modalities == ("audio",)

    @property
    def is_manual_turns(self) -> bool:
        return self.turn_detection is None

    def to_ga_dict(self) -> dict[str, Any]:
        """The GA ``session`` object for ``session.created`` / ``session.updated``."""
        return {
            "type": "realtime", "output_modalities": list(self.output_modalities),
            "instructions": self.instructions,
            "audio": {
                "input": {"format": self.input_format.to_ga_dict(),
                          "turn_detection": None if self.turn_detection is None else self.turn_detection.to_ga_dict(),
                          "transcription": _plain(self.transcription),
                          "noise_reduction": _plain(self.noise_reduction)},
                "output": {"format": self.output_format.to_ga_dict(), "voice": self.voice, "speed": self.speed},
            },
            "tools": [tool_to_ga(tool) for tool in self.tools], "tool_choice": tool_choice_to_ga(self.tool_choice),
            "max_output_tokens": "inf" if self.max_output_tokens is None else self.max_output_tokens,
        }

    def updated(self, patch: Mapping[str, Any]) -> SessionConfig:
        """This session with a ``normalize_session_patch`` result merged in (PATCH semantics)."""
        merged = merge_patch(self.to_ga_dict(), patch)
        if self.temperature is not None and "temperature" not in patch:
            merged["temperature"] = self.temperature
        return SessionConfig.from_ga_dict(merged)

    @staticmethod
    def from_ga_dict(session: Mapping[str, Any], path: str = "session") -> SessionConfig:
        """Validate a complete GA session dict; raises FieldError naming the bad ``param``."""
        audio = as_object(session.get("audio", {}), join(path, "audio"))
        audio_in = as_object(audio.get("input", {}), join(path, "audio.input"))
        audio_out = as_object(audio.get("output", {}), join(path, "audio.output"))
        modalities = session.get("output_modalities", ["audio"])
        tools = parse_tools(session.get("tools", []), join(path, "tools"))
        tool_choice = parse_tool_choice(session.get("tool_choice", "auto"), join(path, "tool_choice"))
        check_choice(tool_choice, tools, join(path, "tool_choice"))
        return SessionConfig(
            output_modalities=parse_modalities(modalities, join(path, "output_modalities")),
            instructions=as_str(session.get("instructions", ""), join(path, "instructions")),
            input_format=parse_audio_format(audio_in.get("format", {}), join(path, "audio.input.format")),
            output_format=parse_audio_format(audio_out.get("format", {}), join(path, "audio.output.format")),
            turn_detection=parse_turn_detection(audio_in.get("turn_detection"),
                                                 join(path, "audio.input.turn_detection")),
            transcription=parse_transcription(audio_in.get("transcription"), join(path, "audio.input.transcription")),
            noise_reduction=parse_noise_reduction(audio_in.get("noise_reduction"),
                                                   join(path, "audio.input.noise_reduction")),
            voice=parse_voice(audio_out.get("voice", DEFAULT_VOICE), join(path, "audio.output.voice")),
            speed=as_float(audio_out.get("speed", 1.0), join(path, "audio.output.speed"), minimum=0.25, maximum=1.5),
            max_output_tokens=parse_max_output_tokens(session.get("max_output_tokens", "inf"),
                                                      join(path, "max_output_tokens")),
            temperature=None if session.get("temperature") is None else as_float(
                session["temperature"], join(path, "temperature"), minimum=0.0, maximum=2.0),
            tools=tools, tool_choice=tool_choice,
        )


DEFAULT_SESSION = SessionConfig()


def normalize_session_patch(raw: object, path: str = "session") -> dict[str, Any]:
    """Validate a ``session.update`` payload (GA or beta) and return it in the GA shape.

    Raises FieldError; the result applies to any valid session with ``SessionConfig.updated``.
    """
    session = as_object(raw, path)
    check_keys(session, path, _GA_KEYS | set(_BETA_KEYS) | _IGNORED_KEYS)
    if "type" in session:
        kind = as_str(session["type"], join(path, "type"))
        if kind == "transcription":
            raise FieldError(UNSUPPORTED, "Transcription-only sessions are not supported; use 'realtime'.",
                             join(path, "type"))
        as_choice(kind, join(path, "type"), ("realtime",))
    check_unserved(session, path)
    patch: dict[str, Any] = {}
    for key, target in _BETA_KEYS.items():
        if key in session:
            # NOTE: beta values are checked under their own name, so the error's param is what the client sent.
            _set_path(patch, target, _BETA_CHECKS[key](session[key], join(path, key)))
    ga = {k: session[k] for k in ("output_modalities", "instructions", "audio", "max_output_tokens", "temperature",
                                  "tools", "tool_choice") if k in session}
    if "audio" in ga:
        ga["audio"] = _canonical_audio(ga["audio"], join(path, "audio"))
    patch = merge_patch(patch, ga)
    # NOTE: validating against the defaults checks every value in the patch; merging into any other valid
    # session cannot fail, because nested objects that change `type` are replaced whole (merge_patch).
    SessionConfig.from_ga_dict(merge_patch(DEFAULT_SESSION.to_ga_dict(), patch), path)
    return patch


def merge_patch(base: Mapping[str, Any], patch: Mapping[str, Any]) -> dict[str, Any]:
    """``base`` with ``patch`` merged in: objects key by key (unless ``type`` changes), the rest replaced."""
    merged = dict(base)
    for key, value in patch.items():
        current = merged.get(key)
        if isinstance(value, dict) and isinstance(current, dict) and value.get("type", current.get("type")) == \
                current.get("type"):
            merged[key] = merge_patch(current, value)
        else:
            merged[key] = value
    return merged


def _canonical_audio(raw: object, path: str) -> dict[str, Any]:
    """``audio`` with unknown keys refused, formats made whole and turn detection given its ``type``."""
    audio = dict(as_object(raw, path))
    check_keys(audio, path, {"input", "output"})
    for side, keys in (("input", {"format", "turn_detection", "transcription", "noise_reduction"}),
                       ("output", {"format", "voice", "speed"})):
        if side not in audio:
            continue
        spec = dict(as_object(audio[side], join(path, side)))
        check_keys(spec, join(path, side), keys)
        # NOTE: a format is replaced whole (a missing type means audio/pcm), and a turn detection object
        # must name its type: then merging the patch into any valid session gives a valid session.
        if "format" in spec:
            spec["format"] = parse_audio_format(spec["format"], join(path, f"{side}.format")).to_ga_dict()
        detection = spec.get("turn_detection")
        if detection is not None:
            detection_path = join(path, "input.turn_detection")
            require(as_object(detection, detection_path), "type", detection_path)
        audio[side] = spec
    return audio


def _checked(parser: Callable[[Any, str], Any], raw: Any, path: str) -> Any:
    parser(raw, path)
    return raw


def _beta_turn_detection(raw: object, path: str) -> Any:
    if raw is not None:
        require(as_object(raw, path), "type", path)
    parse_turn_detection(raw, path)
    return raw


_BETA_CHECKS: dict[str, Callable[[Any, str], Any]] = {
    "modalities": lambda raw, path: list(parse_modalities(raw, path)),
    "input_audio_format": lambda raw, path: parse_beta_format(raw, path).to_ga_dict(),
    "output_audio_format": lambda raw, path: parse_beta_format(raw, path).to_ga_dict(),
    "turn_detection": _beta_turn_detection,
    "input_audio_transcription": lambda raw, path: _checked(parse_transcription, raw, path),
    "input_audio_noise_reduction": lambda raw, path: _checked(parse_noise_reduction, raw, path),
    "voice": lambda raw, path: _checked(parse_voice, raw, path),
    "speed": lambda raw, path: as_float(raw, path, minimum=0.25, maximum=1.5),
    "max_response_output_tokens": lambda raw, path: _checked(parse_max_output_tokens, raw, path),
}


def _set_path(target: dict[str, Any], keys: tuple[str, ...], value: Any) -> None:
    for key in keys[:-1]:
        target = target.setdefault(key, {})
    target[keys[-1]] = value


def _plain(value: Mapping[str, Any] | None) -> dict[str, Any] | None:
    return None if value is None else dict(value)
