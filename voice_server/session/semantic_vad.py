"""`SemanticTurnDetector`: `semantic_vad` turn detection of one session: Silero VAD says where speech is,
`EndOfTurn` (`end_of_turn.py`) decides when the turn is over, asking the caller for Smart Turn scores.

Why Silero for onsets and pauses (measured in `loadtest/bench_vad_noise.py`, docs/BENCHMARKS.md): webrtcvad
opened a turn on every 180 ms noise burst and every synthetic cough (12/12 each), Silero on none, and
Silero keeps ~0.96 of speech frames at 5 dB SNR of white noise where webrtcvad keeps ~0.87. It costs
~0.15 ms per 32 ms window, run inline in the session's `feed`, and not at all on a window under `SILENT_DB`
while no turn is open (an open microphone's silence: most of a call).

The models are loaded once per process (`shared_models`) and shared by every session: Silero's
`InferenceSession` (each stream keeps its own recurrent state) and `SmartTurnModel`, whose `predict`
(~50-100 ms on one core) the session runs in a worker thread so the event loop never waits for it.

Interface as `TurnDetector`'s (`feed` -> events on the input timeline, `is_speaking`, `turn_start_ms`,
`reset`), plus `SilenceStarted` / `SpeechResumed` events and `on_score` for the score a `SilenceStarted`
asked for. Input at 8, 24 or 48 kHz is resampled to 16 kHz, the filter's delay dropped (as in `vad.py`),
so window `i` is exactly input `[32 i, 32 i + 32)` ms. A session builds it at 16 kHz and feeds it the input its
`InputBuffer` has resampled already (one resampler per session, shared with the recogniser and Smart Turn).
"""

from __future__ import annotations

import functools
import statistics
import threading
from collections import deque
from dataclasses import dataclass
from typing import cast

import numpy as np
import numpy.typing as npt
import onnxruntime as ort

from voice_server.audio import AlignedResampler, pcm16_to_float32, resample_signal
from voice_server.session.end_of_turn import (
    HYSTERESIS,
    SPEECH_THRESHOLD,
    WINDOW_MS,
    EndOfTurn,
    Phase,
    SilenceStarted,
    SpeechResumed,
)
from voice_server.session.turn_config import TurnDetectionConfig
from voice_server.session.turn_models import SileroVad, SmartTurnModel, load_silero_session
from voice_server.session.vad import INPUT_RATES

__all__ = ["SILENT_DB", "EndOfTurnModels", "QuietGate", "SemanticTurnDetector", "SilenceStarted", "SpeechResumed",
           "shared_models"]

MODEL_RATE = 16000
QUIET_DB = -50.0
"""A 32 ms window under this RMS level holds no speech at a talking level (`EndOfTurn`'s `is_quiet`),
whatever the line's noise floor."""
FLOOR_MARGIN_DB = 3.0
"""A window within this much of the line's noise floor is quiet: white noise's 32 ms windows stay within
~0.5 dB of its level. Not more: a word's soft fricative 20 dB under the speaker ("of France") comes
within ~4 dB of a floor 20 dB down, and three such windows in a row would make a pause mid-sentence."""
SPEECH_MARGIN_DB = 15.0
"""...and always this much under the speaker's level (the upper quartile of speech windows: a word's loud
part, near its active speech level; their median falls in the soft parts): at a low SNR a word's soft
sounds sit near the floor, and Silero alone decides (as with no gate)."""
NUM_LEVEL_WINDOWS = 64
"""Speech windows (~2 s) that give the speaker's level."""
NUM_FLOOR_WINDOWS = 16
"""Non-speech windows (~0.5 s, the latest) that give the line's floor. Not more: noise that starts with
the call's speaker (a street, a car, a fan switched on) must move the floor before their first pause; with
~2 s of a quiet room still in the median, the gate stayed at `QUIET_DB` through a whole question on a line
that turned noisy 0.3 s before it, and each pause came with Silero's 60-200 ms lag
(`loadtest/bench_turntaking.py`'s noisy items: 83 ms median from the last word to the end of speech,
2 ms with the floor on these windows). A cough among them moves the median for a moment only, and the
gate is always `SPEECH_MARGIN_DB` under the speaker."""
SILENT_DB = -55.0
"""With no turn open, a 32 ms window under this RMS level is silence: Silero is not run on it (it scores 0;
`SileroVad.skip` replays the last few such windows through the model before the next one it scores). So this
is the quietest sound that opens a turn, 29 dB under a talker at -26 dBFS; in an open turn every window is
scored (the gate above needs them). Why: an open microphone in a quiet room, behind a browser's noise
suppression or on a silent phone line is under it most of a call, and Silero was the largest part (35%) of the
server's CPU for such microphones: 8 on `/ws` took 0.19 of a core with every window scored, 0.12 without
(`loadtest/bench_open_mics.py`)."""
MIN_NOISE_WINDOWS = 8
"""The floor is not guessed from less (~0.25 s); until then the gate is `QUIET_DB`."""


class QuietGate:
    """Which windows are quiet (`EndOfTurn`'s `is_quiet`), on a line's own noise floor.

    A fixed level (`QUIET_DB`) never fires on a noisy line (a phone, a street, a fan), which left the
    60-200 ms of Silero's lag after the last word in every pause there. The gate follows the median
    level of the last windows Silero calls non-speech (the floor, over ~0.5 s) and the upper quartile of
    those it calls speech (the speaker, over ~2 s), so a cough or a burst among them moves neither for
    long: a window is quiet under
    `min(floor + FLOOR_MARGIN_DB, speaker - SPEECH_MARGIN_DB)`, and always under `QUIET_DB`."""

    def __init__(self) -> None:
        self._noise: deque[float] = deque(maxlen=NUM_FLOOR_WINDOWS)
        self._speech: deque[float] = deque(maxlen=NUM_LEVEL_WINDOWS)
        self.level_db = QUIET_DB
        """Windows under this RMS level are quiet."""

    def is_quiet(self, probability: float, level_db: float) -> bool:
        if probability < SPEECH_THRESHOLD - HYSTERESIS:
            self._noise.append(level_db)
        elif probability >= SPEECH_THRESHOLD:
            self._speech.append(level_db)
        if len(self._noise) >= MIN_NOISE_WINDOWS:
            level = statistics.median(self._noise) + FLOOR_MARGIN_DB
            if self._speech:
                loud = sorted(self._speech)[len(self._speech) * 3 // 4]  # NOTE: words' loud parts
                level = min(level, loud - SPEECH_MARGIN_DB)
            self.level_db = max(QUIET_DB, level)
        return level_db < self.level_db


@dataclass(frozen=True)
class EndOfTurnModels:
    silero: ort.InferenceSession
    """Silero's onnxruntime `InferenceSession`, shared by every `SileroVad` stream."""
    smart_turn: SmartTurnModel


_LOCK = threading.Lock()


@functools.cache
def _load() -> EndOfTurnModels:
    return EndOfTurnModels(load_silero_session(num_threads=1), SmartTurnModel(num_threads=1))


def shared_models() -> EndOfTurnModels:
    """This process's end-of-turn models, loaded at the first call (~0.3 s); RuntimeError naming the
    package to install when their files are missing."""
    with _LOCK:  # NOTE: functools.cache alone could load twice when two threads ask at once
        return _load()


class SemanticTurnDetector:
    def __init__(self, config: TurnDetectionConfig, input_rate: int, models: EndOfTurnModels | None = None) -> None:
        if not isinstance(config, TurnDetectionConfig) or not config.is_semantic:
            raise ValueError(f"config must be a semantic_vad TurnDetectionConfig, got {config!r:.80}")
        if isinstance(input_rate, bool) or not isinstance(input_rate, int) or input_rate not in INPUT_RATES:
            raise ValueError(f"input_rate must be one of {INPUT_RATES} Hz, got {input_rate!r}")
        self.config, self.input_rate = config, input_rate
        self.models = models or shared_models()
        self.machine = EndOfTurn(config)
        self._vad = SileroVad(self.models.silero)
        self.gate = QuietGate()
        self.silent_db = SILENT_DB
        """With no turn open, windows under this level score 0 without Silero (`SILENT_DB`)."""
        self._resampler = None if input_rate == MODEL_RATE else AlignedResampler(input_rate, MODEL_RATE)

    @property
    def is_speaking(self) -> bool:
        """Whether a turn is open (speaking or paused, not yet committed)."""
        return self.machine.phase is not Phase.IDLE

    @property
    def turn_start_ms(self) -> int | None:
        return self.machine.turn_start_ms

    @property
    def speech_ms(self) -> int:
        """Speech heard in the open turn so far (its VAD windows, pauses left out)."""
        return self.machine.num_speech_windows * WINDOW_MS if self.is_speaking else 0

    @property
    def silence_ms(self) -> int:
        """How long the speaker of the open turn has been silent (0 while speaking or with no turn)."""
        machine = self.machine
        return machine.now_ms - machine.speech_end_ms if machine.phase is Phase.PAUSED else 0

    def reset(self) -> None:
        self.machine.reset()

    def feed(self, samples: npt.NDArray[np.float32] | npt.NDArray[np.int16]) -> list[object]:
        """The events that the next chunk (1-D float32 in [-1, 1) or int16, any length) completes."""
        if not isinstance(samples, np.ndarray) or samples.ndim != 1 or samples.dtype not in (np.float32, np.int16):
            got = f"{samples.dtype} array of shape {samples.shape}" if isinstance(samples, np.ndarray) else type(
                samples).__name__
            raise ValueError(f"samples must be a 1-D float32 or int16 numpy array of mono audio, got {got}")
        audio: npt.NDArray[np.float32] = (pcm16_to_float32(cast(npt.NDArray[np.int16], samples))
                                          if samples.dtype == np.int16 else cast(npt.NDArray[np.float32], samples))
        if not np.isfinite(audio).all():
            raise ValueError("samples holds non-finite values (NaN or inf)")
        if self._resampler is not None:
            audio = self._resampler.process(audio)
        events: list[object] = []
        vad, machine = self._vad, self.machine
        for window, level_db in vad.windows(audio):
            is_skipped = level_db < self.silent_db and machine.phase is Phase.IDLE
            probability = vad.skip(window) if is_skipped else vad.score(window)
            events.extend(machine.step(probability, self.gate.is_quiet(probability, level_db)))
        return events

    def on_score(self, token: int, probability: float, is_unfinished: bool = False,
                 is_maybe_unfinished: bool = False) -> list[object]:
        """The Smart Turn probability for the pause whose `SilenceStarted` carried `token`, whether the
        turn's words end where a sentence cannot, and whether they may (`read_pause_words`, `EndOfTurn.on_score`)."""
        return self.machine.on_score(token, probability, is_unfinished, is_maybe_unfinished)

    def score(self, audio: npt.NDArray[np.int16]) -> float:
        """Smart Turn's probability that the turn in `audio` (int16 at the input rate, its last 8 s used)
        is complete. Blocking (~50-100 ms): run it in a worker thread."""
        pcm = pcm16_to_float32(audio[-self.input_rate * SmartTurnModel.MAX_AUDIO_S:])
        if self.input_rate != MODEL_RATE:
            pcm = resample_signal(pcm, self.input_rate, MODEL_RATE)
        return self.models.smart_turn.predict(pcm) if pcm.size else 0.0
