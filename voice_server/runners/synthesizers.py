"""The speech engines behind `TTSRunner`: one small protocol, one adapter per engine.

`TTSRunner` (and its clause rule) stays engine-free; an adapter turns one clause of text into
float32 PCM at its engine's own rate, and the session layer resamples whatever rate it announces.

- `HibariSynthesizer`: hibari-tts (Apache-2.0, 24 kHz), the default. Its noise comes from the
  request's own seeded generator, so a text always gives the same audio.
- `PiperSynthesizer`: a Piper voice (piper-tts is GPL-3.0-or-later: an opt-in extra, never a
  default). Its VITS graph draws its noise inside onnxruntime, with no seed input, so the same text
  gives slightly different audio each time.

Loading (and the checks that nothing downloads) lives in `voice_server/stages/tts_engines.py`.
"""

from __future__ import annotations

from typing import Any, Protocol

import numpy as np
import numpy.typing as npt

HIBARI_RATE = 24000
PIPER_RATE = 22050
"""The bundled `en_US-joe-medium` voice's rate (a Piper `medium` voice)."""


class Synthesizer(Protocol):
    """One clause of text -> mono float32 PCM at `sample_rate`, one array per sentence (the engine's own
    split), so that the runner can trim the silence each sentence carries (`speech_edges.py`)."""

    @property
    def sample_rate(self) -> int: ...

    def synthesize(self, text: str, speed: float, rng: np.random.Generator) -> list[npt.NDArray[np.float32]]:
        """`speed` 0.5 (slow) .. 2.0 (fast); `rng` is the request's noise generator (an engine with
        its own noise ignores it). Nothing speakable -> an empty list."""
        ...


def _sentences(pieces: list[Any]) -> list[npt.NDArray[np.float32]]:
    return [np.asarray(p, dtype=np.float32).reshape(-1) for p in pieces]


class HibariSynthesizer:
    """Over a `hibari.Hibari`: G2P splits the clause into sentences, each synthesised from its ids."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self._rate = int(engine.sample_rate)

    @property
    def sample_rate(self) -> int:
        return self._rate

    def synthesize(self, text: str, speed: float, rng: np.random.Generator) -> list[npt.NDArray[np.float32]]:
        engine = self.engine
        return _sentences([engine.from_ids(engine.ids(ps), float(speed), rng) for ps in engine.phonemize(text)])


class PiperSynthesizer:
    """Over a `piper.PiperVoice` (espeak-ng phonemes): one audio chunk per sentence of the clause."""

    def __init__(self, voice: Any) -> None:
        self.voice = voice
        self._rate = int(voice.config.sample_rate)
        self._length_scale = float(voice.config.length_scale)

    @property
    def sample_rate(self) -> int:
        return self._rate

    def synthesize(self, text: str, speed: float, rng: np.random.Generator) -> list[npt.NDArray[np.float32]]:
        from piper import SynthesisConfig

        # NOTE: Piper's pace is a phoneme length scale (> 1 slower): the voice's own scale over `speed`.
        # `rng` goes unused: the model has no noise input (see the module docstring).
        config = SynthesisConfig(length_scale=self._length_scale / float(speed))
        return _sentences([chunk.audio_float_array for chunk in self.voice.synthesize(text, syn_config=config)])
