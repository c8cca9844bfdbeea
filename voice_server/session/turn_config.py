"""Turn-detection settings of a session: the OpenAI Realtime ``server_vad`` or ``semantic_vad`` object, validated.

``server_vad`` ends a turn after a fixed silence (``TurnDetector``, webrtcvad). ``semantic_vad`` ends it
when the speaker sounds done (``SemanticTurnDetector``: Silero VAD for speech, Smart Turn for the end
of the turn), waiting longer after a pause that sounds unfinished; ``eagerness`` sets how readily.

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

__all__ = ["DEFAULT_MIN_SPEECH_MS", "EAGERNESS", "SEMANTIC_MIN_SPEECH_MS", "Eagerness", "TurnDetectionConfig"]

# NOTE: not an OpenAI field; 120 ms rejects clicks, coughs' onsets and keyboard taps (tens of ms, which
# webrtcvad flags as voiced for a frame or two) while the shortest real barge-ins ("no", "wait") last
# 150-300 ms. Each extra millisecond here is a millisecond of barge-in latency: a turn cannot start
# before ``min_speech_ms`` of speech has been heard.
DEFAULT_MIN_SPEECH_MS = 120
# NOTE: `semantic_vad`'s Silero opened no turn on a cough or a noise burst even at two windows (0 of 20
# each paused a reply, loadtest/bench_turntaking.py), so its turns open on two 32 ms windows: a reply
# spoken over pauses 64 ms sooner (barge-in stop p50 142 -> 82 ms on /ws).
SEMANTIC_MIN_SPEECH_MS = 64
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
_SEMANTIC_KEYS = ("type", "eagerness", "create_response", "interrupt_response")
TYPES = ("server_vad", "semantic_vad")


@dataclass(frozen=True)
class Eagerness:
    """How `semantic_vad` decides, per OpenAI `eagerness`: commit once the end-of-turn model's
    probability is at least `min_complete` and the speaker has been silent `min_silence_ms`, or after
    `sure_silence_ms` where it is at least `sure_complete`; where the turn's words end where a sentence
    cannot ("I'd like a"), only after `unfinished_silence_ms`; commit whatever the model says after
    `max_silence_ms` of silence."""

    min_complete: float
    min_silence_ms: int
    max_silence_ms: int
    sure_complete: float
    sure_silence_ms: int
    unfinished_silence_ms: int


# NOTE: OpenAI documents only the maximum waits (8 s / 4 s / 2 s); a caller on a phone hears 8 s as a dead
# line, so the waits here are shorter, and `auto` is `medium` as OpenAI says. `min_silence_ms`: where the model
# is not sure (`min_complete` <= score < `sure_complete`), a listener lets a hesitation's pause go by first. At
# 200 ms, medium answered "can you tell me the" (scored 0.89), and the ~200 ms gap a voice leaves before "milk"
# in "i need to buy some milk and" (0.64-0.77), before the speaker went on; finished questions scored 0.969-0.990
# on the turn-taking set's voices over /ws, so the wait cost them nothing there (3 of 41 through a call's 8 kHz
# audio scored under 0.9; loadtest/bench_turntaking.py, BENCHMARKS.md).
# A score of `sure_complete` or more commits once the silence is `sure_silence_ms` (six windows at medium): a
# voice leaves 100-260 ms gaps inside a sentence (the set's "i need to buy some | milk and", which Smart Turn
# scores sure), and the reply prepared during the pause is ready ~250 ms after the speech's end anyway, so
# a commit before that only lets it be heard over a speaker who goes on. `high` commits at the pause.
# `unfinished_silence_ms`: a hesitation's pause in conversation is mostly under a second (the turn-taking
# set's are 400-900 ms), so medium waits 1.2 s; a longer one is taken as the end of the turn.
EAGERNESS = {
    "low": Eagerness(min_complete=0.8, min_silence_ms=1300, max_silence_ms=3000, sure_complete=0.97,
                     sure_silence_ms=288, unfinished_silence_ms=1600),
    "medium": Eagerness(min_complete=0.5, min_silence_ms=1000, max_silence_ms=2000, sure_complete=0.9,
                        sure_silence_ms=192, unfinished_silence_ms=1200),
    "high": Eagerness(min_complete=0.3, min_silence_ms=120, max_silence_ms=1200, sure_complete=0.7,
                      sure_silence_ms=96, unfinished_silence_ms=900),
}
EAGERNESS["auto"] = EAGERNESS["medium"]


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
    ``type`` ``semantic_vad`` ends turns by ``eagerness`` (``EAGERNESS``) instead of ``silence_duration_ms``
    and ``threshold``, which it does not use.
    """

    threshold: float = 0.5
    prefix_padding_ms: int = 300
    silence_duration_ms: int = 500
    min_speech_ms: int | None = None
    """None: the type's own, `DEFAULT_MIN_SPEECH_MS` (server_vad) or `SEMANTIC_MIN_SPEECH_MS`."""
    create_response: bool = True
    interrupt_response: bool = True
    idle_timeout_ms: int | None = None
    type: str = "server_vad"
    eagerness: str = "auto"

    @property
    def is_semantic(self) -> bool:
        return self.type == "semantic_vad"

    @property
    def start_speech_ms(self) -> int:
        """Speech that opens a turn (`min_speech_ms`, filled in on construction)."""
        assert isinstance(self.min_speech_ms, int)
        return self.min_speech_ms

    @property
    def rules(self) -> Eagerness:
        """`semantic_vad`'s decision rule for `eagerness`."""
        return EAGERNESS[self.eagerness]

    def __post_init__(self) -> None:
        if not isinstance(self.type, str) or self.type not in TYPES:
            raise _error("type", f"must be one of {', '.join(map(repr, TYPES))}, got {self.type!r:.40}")
        if not isinstance(self.eagerness, str) or self.eagerness not in EAGERNESS:
            raise _error("eagerness", f"must be one of {', '.join(map(repr, EAGERNESS))}, got {self.eagerness!r:.40}")
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
        if self.min_speech_ms is None:
            object.__setattr__(self, "min_speech_ms",
                               SEMANTIC_MIN_SPEECH_MS if self.is_semantic else DEFAULT_MIN_SPEECH_MS)
        _check_ms("min_speech_ms", self.min_speech_ms, 0, MAX_MIN_SPEECH_MS)
        for field in ("create_response", "interrupt_response"):
            value = getattr(self, field)
            if not isinstance(value, bool):
                raise _error(field, f"must be true or false, got {value!r}")
        if self.idle_timeout_ms is not None:
            _check_ms("idle_timeout_ms", self.idle_timeout_ms, 1, MAX_IDLE_TIMEOUT_MS)

    @classmethod
    def from_openai(cls, d: Mapping[str, Any], *, min_speech_ms: int | None = None) -> TurnDetectionConfig:
        """The config of an OpenAI ``turn_detection`` object (``server_vad`` or ``semantic_vad``); absent
        keys keep defaults.

        Unknown keys are refused (a misspelt ``silence_duration`` must not silently keep the default), and
        so are ``server_vad`` keys on ``semantic_vad``, as OpenAI does. ``min_speech_ms`` is the server's
        own setting, not a client field.
        """
        if not isinstance(d, Mapping):
            raise ValueError(f"turn_detection: must be an object, got {type(d).__name__}")
        kind = d.get("type")
        if not isinstance(kind, str) or kind not in TYPES:
            raise _error("type", f"must be one of {', '.join(map(repr, TYPES))}, got {kind!r:.40}")
        keys = _SEMANTIC_KEYS if kind == "semantic_vad" else _OPENAI_KEYS
        unknown = sorted(str(key) for key in d if key not in keys)
        if unknown:
            raise ValueError(f"turn_detection: unknown key(s) {', '.join(map(repr, unknown))} for {kind}; "
                             f"expected {keys}")
        return cls(**dict(d), min_speech_ms=min_speech_ms)
