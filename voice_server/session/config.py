"""`SessionConfig`: one session's audio rates, instructions, turn detection, noise reduction and request params,
validated on construction (each endpoint builds it from its own protocol's messages)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from voice_server.session.turn_config import TurnDetectionConfig

NOISE_REDUCTION_TYPES = ("near_field", "far_field", None)


@dataclass(frozen=True)
class SessionConfig:
    input_rate: int = 24000
    output_rate: int = 24000
    instructions: str = ""
    turn_detection: TurnDetectionConfig | None = TurnDetectionConfig()
    """None: manual turns (the client commits and asks for responses)."""
    params: tuple[tuple[str, Any], ...] = ()
    """Request params every response sends (e.g. sampling), as items so the config stays hashable."""
    noise_reduction: str | None = None
    """`near_field` or `far_field` (OpenAI's two types; both run the same model, RNNoise: `audio/denoise.py`) on
    the input before turn detection and recognition; None: off, the default (OpenAI's too): it helps the asr
    in steady noise but hurts it in babble and on clean speech, and delays every end of turn by ~35 ms
    (docs/BENCHMARKS.md, "Noise reduction of the input")."""

    def request_params(self) -> dict[str, Any]:
        """What every request of the session sends: `params`, and `source_rate`, the rate the user's audio
        comes at (the pipeline gets it at 16 kHz; the asr stage hears 8 kHz telephone audio from its own
        starting point: `voice_server/runners/asr_decoders.py`)."""
        return {**dict(self.params), "source_rate": self.input_rate}

    def __post_init__(self) -> None:
        for name in ("input_rate", "output_rate"):
            value = getattr(self, name)
            if value not in (8000, 16000, 24000, 48000):
                raise ValueError(f"{name}: must be 8000, 16000, 24000 or 48000, got {value!r}")
        if not isinstance(self.instructions, str) or len(self.instructions) > 100_000:
            raise ValueError("instructions: must be a string of at most 100000 characters")
        if self.noise_reduction not in NOISE_REDUCTION_TYPES:
            raise ValueError(f"noise_reduction: must be one of {NOISE_REDUCTION_TYPES}, got {self.noise_reduction!r}")
