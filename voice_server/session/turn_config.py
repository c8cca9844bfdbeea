"""Turn-detection settings of a session: the OpenAI Realtime ``server_vad`` object, validated.

Every error names the field as a client wrote it, e.g. ``turn_detection.threshold: must be in [0, 1], got 2``,
so a ``session.update`` can be answered with an error event that says exactly what to fix.

Units: every duration is in milliseconds of the session's input audio. The detector works on 20 ms
frames, so durations take effect rounded up to whole frames (``TurnDetector`` documents the details).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

__all__ = ["DEFAULT_MIN_SPEECH_MS", "TurnDetectionConfig"]

# NOTE: not an OpenAI field; 120 ms rejects clicks, coughs' onsets and keyboard taps (tens of ms, which
# webrtcvad flags as voiced for a frame or two) while the shortest real barge-ins ("no", "wait") last
# 150-300 ms. Each extra millisecond here is a millisecond of barge-in latency: a turn cannot start
# before ``min_speech_ms`` of speech has been heard.
DEFAULT_MIN_SPEECH_MS = 120
# NOTE: server-side bounds (OpenAI documents none) so that the audio a session keeps for the prefix and
# the wait before a turn ends stay bounded whatever a client sends.
MAX_PREFIX_PADDING_MS = 5_000
MAX_SILENCE_DURATION_MS = 10_000
MAX_MIN_SPEECH_MS = 2_000
MAX_IDLE_TIMEOUT_MS = 3_600_000

_OPENAI_KEYS = (
    "type",
    "threshold",
    "prefix_padding_ms",
    "silence_duration_ms",
    "create_response",
    "interrupt_response",
    "idle_timeout_ms",
)


def _error(field: str, message: str) -> ValueError:
    return ValueError(f"turn_detection.{field}: {message}")


def _check_ms(field: str, value: object, low: int, high: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise _error(field, f"must be an integer number of milliseconds, got {value!r}")
    if not low <= value <= high:
        raise _error(field, f"must be in [{low}, {high}] ms, got {value}")


@dataclass(frozen=True)
class TurnDetectionConfig:
    """Server VAD settings; validated on construction (ValueError naming the field).

    ``threshold`` (0..1): higher needs clearer speech to open a turn (``vad.py`` explains the mapping).
    ``prefix_padding_ms``: audio kept before the detected start; ``SpeechStarted.audio_start_ms`` is
    moved earlier by it. ``silence_duration_ms``: silence that ends a turn. ``min_speech_ms``: speech
    shorter than this never opens a turn. ``create_response``, ``interrupt_response`` and
    ``idle_timeout_ms`` (None: no idle timeout) are kept for the session; the detector ignores them.
    """

    threshold: float = 0.5
    prefix_padding_ms: int = 300
    silence_duration_ms: int = 500
    min_speech_ms: int = DEFAULT_MIN_SPEECH_MS
    create_response: bool = True
    interrupt_response: bool = True
    idle_timeout_ms: int | None = None

    def __post_init__(self) -> None:
        threshold = self.threshold
        # NOTE: isfinite only for floats: a huge JSON integer would overflow the conversion (OverflowError).
        if isinstance(threshold, bool) or not isinstance(threshold, int | float) or (
                isinstance(threshold, float) and not math.isfinite(threshold)):
            raise _error("threshold", f"must be a number in [0, 1], got {threshold!r:.40}")
        if not 0.0 <= threshold <= 1.0:
            raise _error("threshold", f"must be in [0, 1], got {threshold}")
        # NOTE: JSON may carry 0 or 1 as integers; store a float so equal settings compare equal.
        object.__setattr__(self, "threshold", float(threshold))
        _check_ms("prefix_padding_ms", self.prefix_padding_ms, 0, MAX_PREFIX_PADDING_MS)
        _check_ms("silence_duration_ms", self.silence_duration_ms, 0, MAX_SILENCE_DURATION_MS)
        _check_ms("min_speech_ms", self.min_speech_ms, 0, MAX_MIN_SPEECH_MS)
        for field in ("create_response", "interrupt_response"):
            value = getattr(self, field)
            if not isinstance(value, bool):
                raise _error(field, f"must be true or false, got {value!r}")
        if self.idle_timeout_ms is not None:
            _check_ms("idle_timeout_ms", self.idle_timeout_ms, 1, MAX_IDLE_TIMEOUT_MS)

    @classmethod
    def from_openai(cls, d: Mapping[str, Any], *, min_speech_ms: int = DEFAULT_MIN_SPEECH_MS) -> TurnDetectionConfig:
        """The config of an OpenAI ``turn_detection`` object of type ``server_vad``; absent keys keep defaults.

        Unknown keys are refused (a misspelt ``silence_duration`` must not silently keep the default).
        ``min_speech_ms`` is the server's own setting, not a client field.
        """
        if not isinstance(d, Mapping):
            raise ValueError(f"turn_detection: must be an object, got {type(d).__name__}")
        unknown = sorted(str(key) for key in d if key not in _OPENAI_KEYS)
        if unknown:
            raise ValueError(f"turn_detection: unknown key(s) {', '.join(map(repr, unknown))}; expected {_OPENAI_KEYS}")
        if d.get("type") != "server_vad":
            raise _error("type", f"must be 'server_vad', got {d.get('type')!r}")
        fields = {key: value for key, value in d.items() if key != "type"}
        return cls(**fields, min_speech_ms=min_speech_ms)
