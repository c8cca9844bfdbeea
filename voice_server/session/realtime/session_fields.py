"""Field types and parsers shared by ``session.update`` and ``response.create``: audio formats, voices,
modalities, token limits and ``server_vad`` turn detection. Parsers raise FieldError naming the ``param``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from voice_server.session.realtime.errors import (
    UNSUPPORTED,
    FieldError,
    as_bool,
    as_choice,
    as_float,
    as_int,
    as_object,
    as_str,
    check_keys,
    invalid_type,
    invalid_value,
    join,
    require,
)

PCM_RATE_HZ = 24000
G711_RATE_HZ = 8000
FORMAT_RATES_HZ = {"audio/pcm": PCM_RATE_HZ, "audio/pcmu": G711_RATE_HZ, "audio/pcma": G711_RATE_HZ}
BETA_FORMATS = {"pcm16": "audio/pcm", "g711_ulaw": "audio/pcmu", "g711_alaw": "audio/pcma"}
MODALITIES = ("audio", "text")
VAD_TYPES = ("server_vad", "semantic_vad")
EAGERNESS_LEVELS = ("low", "medium", "high", "auto")
NOISE_REDUCTION_TYPES = ("near_field", "far_field")
MAX_OUTPUT_TOKENS_LIMIT = 4096


@dataclass(frozen=True)
class AudioFormat:
    """``audio/pcm`` (PCM16 LE mono, 24 kHz only) or G.711 ``audio/pcmu`` / ``audio/pcma`` (8 kHz)."""

    type: str = "audio/pcm"

    def __post_init__(self) -> None:
        if self.type not in FORMAT_RATES_HZ:
            raise ValueError(f"audio format must be one of {sorted(FORMAT_RATES_HZ)}, got {self.type!r}")

    @property
    def rate_hz(self) -> int:
        return FORMAT_RATES_HZ[self.type]

    @property
    def is_g711(self) -> bool:
        return self.type != "audio/pcm"

    def to_ga_dict(self) -> dict[str, Any]:
        return {"type": self.type, "rate": PCM_RATE_HZ} if self.type == "audio/pcm" else {"type": self.type}


@dataclass(frozen=True)
class ServerVad:
    """``server_vad`` or ``semantic_vad`` turn detection (``type``); field names follow the wire
    (``create_response``...). ``semantic_vad`` uses ``eagerness`` and not the silence fields."""

    threshold: float = 0.5
    prefix_padding_ms: int = 300
    silence_duration_ms: int = 500
    create_response: bool = True
    interrupt_response: bool = True
    idle_timeout_ms: int | None = None
    type: str = "server_vad"
    eagerness: str = "auto"

    def __post_init__(self) -> None:
        if self.type not in VAD_TYPES or self.eagerness not in EAGERNESS_LEVELS:
            raise ValueError(f"type must be one of {VAD_TYPES} and eagerness one of {EAGERNESS_LEVELS}, got "
                             f"{self.type!r}, {self.eagerness!r}")
        if not 0.0 <= self.threshold <= 1.0:
            raise ValueError(f"threshold must be in [0, 1], got {self.threshold}")
        if self.prefix_padding_ms < 0 or self.silence_duration_ms < 0:
            raise ValueError(f"padding and silence must be >= 0 ms, got {self.prefix_padding_ms}, "
                             f"{self.silence_duration_ms}")
        if self.idle_timeout_ms is not None and self.idle_timeout_ms <= 0:
            raise ValueError(f"idle_timeout_ms must be > 0 or None, got {self.idle_timeout_ms}")

    def to_ga_dict(self) -> dict[str, Any]:
        if self.type == "semantic_vad":
            return {"type": "semantic_vad", "eagerness": self.eagerness, "create_response": self.create_response,
                    "interrupt_response": self.interrupt_response}
        return {"type": "server_vad", "threshold": self.threshold, "prefix_padding_ms": self.prefix_padding_ms,
                "silence_duration_ms": self.silence_duration_ms, "create_response": self.create_response,
                "interrupt_response": self.interrupt_response, "idle_timeout_ms": self.idle_timeout_ms}


def parse_audio_format(raw: object, path: str) -> AudioFormat:
    fmt = as_object(raw, path)
    check_keys(fmt, path, {"type", "rate"})
    kind = as_choice(fmt.get("type", "audio/pcm"), join(path, "type"), tuple(FORMAT_RATES_HZ))
    if "rate" in fmt:
        rate = as_int(fmt["rate"], join(path, "rate"))
        if rate != FORMAT_RATES_HZ[kind]:
            raise invalid_value(join(path, "rate"), f"{kind} is only supported at {FORMAT_RATES_HZ[kind]} Hz, "
                                                    f"got {rate}.")
    return AudioFormat(kind)


def parse_voice(raw: object, path: str) -> str:
    """A voice name, or the GA custom-voice object ``{"id": ...}`` (kept as its id)."""
    if isinstance(raw, dict):
        check_keys(raw, path, {"id"})
        return as_str(require(raw, "id", path), join(path, "id"), is_nonempty=True)
    return as_str(raw, path, is_nonempty=True)


def parse_max_output_tokens(raw: object, path: str) -> int | None:
    if raw == "inf":
        return None
    if isinstance(raw, str):
        raise invalid_value(path, f"expected an integer or 'inf', got '{raw}'.")
    return as_int(raw, path, minimum=1, maximum=MAX_OUTPUT_TOKENS_LIMIT)


def parse_modalities(raw: object, path: str) -> tuple[str, ...]:
    # NOTE: GA allows one modality, beta allowed ["audio", "text"]; audio output always carries its
    # transcript, so any list holding "audio" means audio rather than an error.
    if not isinstance(raw, list):
        raise invalid_type(path, "an array", raw)
    if not raw:
        raise invalid_value(path, "must hold 'audio' or 'text'.")
    values = [as_choice(v, f"{path}[{i}]", MODALITIES) for i, v in enumerate(raw)]
    return ("audio",) if "audio" in values else ("text",)


def parse_turn_detection(raw: object, path: str) -> ServerVad | None:
    if raw is None:
        return None
    vad = as_object(raw, path)
    kind = as_choice(as_str(require(vad, "type", path), join(path, "type")), join(path, "type"), VAD_TYPES)
    if kind == "semantic_vad":
        check_keys(vad, path, {"type", "eagerness", "create_response", "interrupt_response"})
        return ServerVad(
            type=kind, eagerness=as_choice(vad.get("eagerness", "auto"), join(path, "eagerness"), EAGERNESS_LEVELS),
            create_response=as_bool(vad.get("create_response", True), join(path, "create_response")),
            interrupt_response=as_bool(vad.get("interrupt_response", True), join(path, "interrupt_response")))
    check_keys(vad, path, {"type", "threshold", "prefix_padding_ms", "silence_duration_ms", "create_response",
                           "interrupt_response", "idle_timeout_ms"})
    defaults = ServerVad()
    idle = vad.get("idle_timeout_ms")
    return ServerVad(
        threshold=as_float(vad.get("threshold", defaults.threshold), join(path, "threshold"), minimum=0.0,
                           maximum=1.0),
        prefix_padding_ms=as_int(vad.get("prefix_padding_ms", defaults.prefix_padding_ms),
                                 join(path, "prefix_padding_ms"), minimum=0, maximum=10_000),
        silence_duration_ms=as_int(vad.get("silence_duration_ms", defaults.silence_duration_ms),
                                   join(path, "silence_duration_ms"), minimum=0, maximum=10_000),
        create_response=as_bool(vad.get("create_response", True), join(path, "create_response")),
        interrupt_response=as_bool(vad.get("interrupt_response", True), join(path, "interrupt_response")),
        idle_timeout_ms=None if idle is None else as_int(idle, join(path, "idle_timeout_ms"), minimum=1),
    )


def parse_transcription(raw: object, path: str) -> Mapping[str, Any] | None:
    if raw is None:
        return None
    spec = as_object(raw, path)
    check_keys(spec, path, {"model", "language", "prompt"})
    return {k: as_str(spec[k], join(path, k)) for k in ("model", "language", "prompt") if spec.get(k) is not None}


def parse_noise_reduction(raw: object, path: str) -> Mapping[str, Any] | None:
    if raw is None:
        return None
    spec = as_object(raw, path)
    check_keys(spec, path, {"type", "strength"})
    out: dict[str, Any] = {"type": as_choice(spec.get("type", "near_field"), join(path, "type"),
                                             NOISE_REDUCTION_TYPES)}
    if spec.get("strength") is not None:
        out["strength"] = as_float(spec["strength"], join(path, "strength"), minimum=0.0)
    return out


def parse_beta_format(raw: object, path: str) -> AudioFormat:
    """A beta format name (``pcm16``, ``g711_ulaw``, ``g711_alaw``)."""
    return AudioFormat(BETA_FORMATS[as_choice(raw, path, tuple(BETA_FORMATS))])


def check_unserved(obj: Mapping[str, Any], path: str) -> None:
    """Refuse a ``prompt`` template: accepting it silently would change nothing."""
    if obj.get("prompt") is not None:
        raise FieldError(UNSUPPORTED, "Prompt templates are not supported by this server.", join(path, "prompt"))
