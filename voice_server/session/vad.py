"""Server-side turn detection: speech start/stop on a session's input audio with webrtcvad.

One ``TurnDetector`` per session (webrtcvad keeps a per-stream noise model). ``feed`` takes chunks of
any size at the session's input rate and returns ``SpeechStarted`` / ``SpeechStopped`` events, with
times in ms of the session's input timeline (all audio fed since the detector was made, as OpenAI's
``audio_start_ms`` / ``audio_end_ms``).

Frames: webrtcvad classifies 20 ms frames of 16-bit PCM at 8/16/32/48 kHz. Input at 8, 16 or 48 kHz is
classified as is; 24 kHz goes through ``AlignedResampler`` to 16 kHz, whose first ``delay_out`` outputs
are dropped so that VAD frame ``f`` is exactly input ``[20 f, 20 f + 20)`` ms: times are never late by
the filter's delay, which shows only as latency (``delay_in`` input samples, 2.5 ms, before a frame is
complete). Input is held until it completes a frame and a partial frame is kept for the next
``feed``, so any chunking gives the same events at the same moments.

Hangover: webrtcvad keeps saying "speech" for a few frames after speech ends (the C code's overhang,
plus a frame of its own filtering): ``HANGOVER_FRAMES[mode]`` = (after a blip of <= 5 frames, after
longer speech), measured on this build and checked by the tests. The rules below subtract it, so
``min_speech_ms`` and ``silence_duration_ms`` are durations of the audio, not of webrtcvad's flags.

Rules, per 20 ms frame (``num_*`` attributes of the detector):

- start: the frame is voiced and at least ``num_start_frames`` of the last ``num_start_window`` frames
  are: one more than the flags (frames + hangover) of the longest speech shorter than ``min_speech_ms``,
  so a blip shorter than that never reaches the count on its own. ``audio_start_ms`` is the
  first voiced frame of that window minus ``prefix_padding_ms``, clamped at 0 and at the end of the
  previous turn (or the last ``reset``): the onset, not the moment of detection.
- stop: ``num_stop_frames`` = ceil(silence_duration_ms / 20) - long hangover (at least 1) unvoiced
  frames in a row. ``audio_end_ms`` is the end of the frame that completes them: the end of speech
  plus ``silence_duration_ms``, which OpenAI's ``speech_stopped`` includes too.

Threshold: webrtcvad gives a boolean per frame at one of 4 aggressiveness modes, so ``threshold``
sets both (see ``vad_mode`` and ``start_ratio``): the mode (a higher one rejects more noise and
breath) and the fraction of voiced frames the start window needs, ``num_start_window`` =
ceil(num_start_frames / start_ratio): at 1.0 the start count must be voiced in a row, lower
thresholds tolerate unvoiced frames (a weak consonant, a dropout) while speech builds up.

Latency (default config, frames of 20 ms): ``SpeechStarted`` comes ``num_start_frames`` frames after
the onset (200 ms: 120 ms of min speech + 80 ms of hangover that a click would also produce);
``SpeechStopped`` comes at ``audio_end_ms``, i.e. ``silence_duration_ms`` after the speech ended (up
to 60 ms sooner when the last word was a blip of <= 100 ms, whose hangover is shorter). 24 kHz input
adds the resampler's 2.5 ms to both.

NOTE: webrtcvad adapts its noise model only on frames it calls non-speech. Noise that first appears
after clean speech (a noiseless TTS clip, digital silence, then a noisy line) can be called speech for
seconds, keeping a turn open; a live microphone's floor runs under the speech too and is learnt.

Turn audio: the detector keeps no audio. The session cuts its own input buffer with the event times
(``ms * input_rate // 1000``; the prefix padding is already in ``audio_start_ms``), so no audio is
copied twice and a cleared buffer is simply the session's to drop.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass
from typing import cast

import numpy as np
import numpy.typing as npt
import webrtcvad

from voice_server.audio import AlignedResampler, float32_to_pcm16, pcm16_to_bytes, pcm16_to_float32
from voice_server.session.turn_config import TurnDetectionConfig

__all__ = [
    "FRAME_MS",
    "HANGOVER_FRAMES",
    "INPUT_RATES",
    "MAX_BLIP_FRAMES",
    "SpeechStarted",
    "SpeechStopped",
    "TurnDetector",
    "TurnEvent",
    "start_ratio",
    "vad_mode",
]

FRAME_MS = 20
INPUT_RATES = (8000, 16000, 24000, 48000)
_VAD_RATES = (8000, 16000, 32000, 48000)  # what webrtcvad takes directly
_RESAMPLE_RATE = 16000
# NOTE: (short, long) frames of "speech" webrtcvad adds after speech ends, on 20 ms frames: after at
# most MAX_BLIP_FRAMES frames of speech, and after more (kOverHangMax1/2 of vad_core.c, plus a frame of
# its filtering). Measured on this build (the tests check it), since the Python API hides the overhang.
HANGOVER_FRAMES = {0: (5, 8), 1: (5, 8), 2: (4, 6), 3: (4, 6)}
MAX_BLIP_FRAMES = 5


def _num_flagged(num_speech_frames: int, mode: int) -> int:
    """Frames webrtcvad flags for a stretch of speech followed by silence: the speech plus its hangover."""
    short, long = HANGOVER_FRAMES[mode]
    return num_speech_frames + (short if num_speech_frames <= MAX_BLIP_FRAMES else long)


def vad_mode(threshold: float) -> int:
    """webrtcvad aggressiveness for a threshold: quarters of [0, 1] map to modes 0..3 (0.5 -> 2)."""
    return min(3, int(threshold * 4))


def start_ratio(threshold: float) -> float:
    """Fraction of the start window that must be voiced: 0.6 at threshold 0, 0.8 at 0.5, 1.0 at 1."""
    # NOTE: never under 0.6, so two clicks far apart (each voiced for itself plus the hangover) cannot
    # add up to a turn inside one window.
    return 0.6 + 0.4 * threshold


@dataclass(frozen=True)
class SpeechStarted:
    """A turn began; ``audio_start_ms`` includes the prefix padding (input timeline, ms)."""

    audio_start_ms: int


@dataclass(frozen=True)
class SpeechStopped:
    """A turn ended; ``audio_end_ms`` includes the closing silence, ``speech_end_ms`` (<= it) is where the
    speech itself ended: the moment a listener starts waiting for the reply (input timeline, ms)."""

    audio_end_ms: int
    speech_end_ms: int = -1

    def __post_init__(self) -> None:
        if self.speech_end_ms < 0:
            object.__setattr__(self, "speech_end_ms", self.audio_end_ms)


TurnEvent = SpeechStarted | SpeechStopped


class TurnDetector:
    """Streaming turn detection for one session (see the module docstring for rules and latency)."""

    def __init__(self, config: TurnDetectionConfig, input_rate: int) -> None:
        if not isinstance(config, TurnDetectionConfig):
            raise ValueError(f"config must be a TurnDetectionConfig, got {type(config).__name__}")
        if isinstance(input_rate, bool) or not isinstance(input_rate, int) or input_rate not in INPUT_RATES:
            raise ValueError(f"input_rate must be one of {INPUT_RATES} Hz, got {input_rate!r}")
        self.config = config
        self.input_rate = input_rate
        self.vad_mode = vad_mode(config.threshold)
        num_min_speech = math.ceil(config.start_speech_ms / FRAME_MS)
        # NOTE: one flag more than the longest speech to reject (num_min_speech - 1 frames) can produce
        # with its hangover; min_speech_ms 0 rejects nothing: the first voiced frame starts a turn.
        self.num_start_frames = _num_flagged(num_min_speech - 1, self.vad_mode) + 1 if num_min_speech else 1
        self.num_start_window = math.ceil(self.num_start_frames / start_ratio(config.threshold))
        hangover_long = HANGOVER_FRAMES[self.vad_mode][1]
        self.num_stop_frames = max(1, math.ceil(config.silence_duration_ms / FRAME_MS) - hangover_long)
        self._num_silent_frames = self.num_stop_frames + hangover_long
        """Frames between the end of speech and the stop: the unvoiced run and webrtcvad's hangover."""
        self._vad = webrtcvad.Vad(self.vad_mode)
        self._resampler = None if input_rate in _VAD_RATES else AlignedResampler(input_rate, _RESAMPLE_RATE)
        self._vad_rate = input_rate if self._resampler is None else _RESAMPLE_RATE
        self._frame_len = self._vad_rate * FRAME_MS // 1000
        self._held: list[npt.NDArray[np.generic]] = []  # input chunks not yet resampled / classified
        self._num_input = 0  # input samples fed in all
        self._pending = np.zeros(0, dtype=np.int16)  # VAD-rate samples of the next, partial frame
        self._num_frames = 0  # frames classified so far: the timeline position is 20 * this (ms)
        self._is_voiced = deque[bool](maxlen=self.num_start_window)
        self._num_unvoiced_run = 0
        self._turn_start_ms: int | None = None
        self._floor_ms = 0  # audio_start_ms never goes before this (the previous turn's end, a reset)
        self._num_input_due = self._input_due()

    @property
    def is_speaking(self) -> bool:
        """Whether a turn is open (a SpeechStarted without its SpeechStopped yet)."""
        return self._turn_start_ms is not None

    @property
    def turn_start_ms(self) -> int | None:
        """The open turn's ``audio_start_ms``, or None."""
        return self._turn_start_ms

    def reset(self) -> None:
        """Forget the open turn and the recent frames (``input_audio_buffer.clear``), emitting nothing.

        The timeline goes on (OpenAI's times count from the session's start, not the buffer's), and so
        do webrtcvad's noise model and the partial frame: the room and the stream have not changed.
        A turn found later never starts before this point.
        """
        self._is_voiced.clear()
        self._num_unvoiced_run = 0
        self._turn_start_ms = None
        self._floor_ms = self._num_frames * FRAME_MS

    def feed(self, samples: npt.NDArray[np.float32] | npt.NDArray[np.int16]) -> list[TurnEvent]:
        """The events that the next chunk (1-D float32 in [-1, 1) or int16, any length) completes."""
        if not isinstance(samples, np.ndarray) or samples.ndim != 1 or samples.dtype not in (np.float32, np.int16):
            got = f"{samples.dtype} array of shape {samples.shape}" if isinstance(samples, np.ndarray) else type(
                samples
            ).__name__
            raise ValueError(f"samples must be a 1-D float32 or int16 numpy array of mono audio, got {got}")
        self._held.append(self._to_held(samples))
        self._num_input += len(samples)
        # NOTE: input is held (not resampled, not converted) until it completes a frame: the events are
        # the same, and a stream of tiny chunks costs one list append each instead of a resampler call.
        if self._num_input < self._num_input_due:
            return []
        block = np.concatenate(self._held)
        self._held.clear()
        pcm = block if self._resampler is None else self._resample(block)
        pending = np.concatenate((self._pending, pcm))
        num_frames = len(pending) // self._frame_len
        events: list[TurnEvent] = []
        frame_bytes = 2 * self._frame_len
        data = pcm16_to_bytes(pending[: num_frames * self._frame_len])
        for index in range(num_frames):
            frame = data[index * frame_bytes : (index + 1) * frame_bytes]
            event = self._step(self._vad.is_speech(frame, self._vad_rate))
            if event is not None:
                events.append(event)
        self._pending = pending[num_frames * self._frame_len :].copy()
        self._num_input_due = self._input_due()
        return events

    def _input_due(self) -> int:
        """Input samples (in all) after which the next frame is complete."""
        num_vad_samples = (self._num_frames + 1) * self._frame_len
        if self._resampler is None:
            return num_vad_samples
        spec = self._resampler.spec
        # NOTE: the smallest N with ceil(N * up / down) >= the outputs due, the dropped delay included.
        return (spec.delay_out + num_vad_samples - 1) * spec.down // spec.up + 1

    def _to_held(self, samples: npt.NDArray[np.float32] | npt.NDArray[np.int16]) -> npt.NDArray[np.generic]:
        """A copy of the chunk as the pipeline takes it: int16 when classified as is, float32 to resample."""
        if samples.dtype == np.int16:
            pcm16 = cast(npt.NDArray[np.int16], samples)
            return pcm16.copy() if self._resampler is None else pcm16_to_float32(pcm16)
        floats = cast(npt.NDArray[np.float32], samples)
        if self._resampler is None:
            return float32_to_pcm16(floats)
        # NOTE: checked before the resampler: a NaN in its history would spoil every later frame.
        if not np.isfinite(floats).all():
            raise ValueError("samples holds non-finite values (NaN or inf)")
        return floats.copy()

    def _resample(self, block: npt.NDArray[np.float32]) -> npt.NDArray[np.int16]:
        assert self._resampler is not None
        return float32_to_pcm16(self._resampler.process(block))

    def _step(self, is_voiced: bool) -> TurnEvent | None:
        """Advance one frame; the event it completes, if any."""
        frame_index = self._num_frames
        self._num_frames += 1
        if self._turn_start_ms is None:
            self._is_voiced.append(is_voiced)
            if not is_voiced or sum(self._is_voiced) < self.num_start_frames:
                return None
            onset = frame_index - len(self._is_voiced) + 1 + self._is_voiced.index(True)
            self._turn_start_ms = max(self._floor_ms, onset * FRAME_MS - self.config.prefix_padding_ms)
            self._num_unvoiced_run = 0
            return SpeechStarted(self._turn_start_ms)
        self._num_unvoiced_run = 0 if is_voiced else self._num_unvoiced_run + 1
        if self._num_unvoiced_run < self.num_stop_frames:
            return None
        audio_end_ms = (frame_index + 1) * FRAME_MS
        speech_end_ms = max(self._turn_start_ms, audio_end_ms - self._num_silent_frames * FRAME_MS)
        self.reset()
        return SpeechStopped(audio_end_ms, speech_end_ms)
