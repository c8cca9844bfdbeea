"""`InputBuffer`: a session's input audio since the last committed turn, at 16 kHz, on the input timeline.

Times are ms of the session's input timeline (all audio received since the session started, as
OpenAI's `audio_start_ms` / `audio_end_ms`); the turn detectors report in the same times, so a turn's
audio is cut from here by its event times and no audio is copied twice.

The audio is kept at `SPEECH_RATE` (16 kHz), the rate of everything that reads it: the end-of-turn models,
the recogniser a turn streams to, and the user items of the conversation. Input at another rate (8 kHz
from a phone call, 24 kHz from a realtime client) is resampled here once, as it arrives (`append` returns
the chunk at 16 kHz for the turn detector and the streamed turn). Before, each reader resampled on its own:
a call's audio twice while a turn was open, and again at each pause (the last 8 s for Smart Turn, 23-37 ms
of numpy on the scoring path) and at each commit (on the event loop).
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

from voice_server.audio import AlignedResampler, float32_to_pcm16, pcm16_to_float32
from voice_server.session.conversation import SPEECH_RATE

__all__ = ["MAX_BUFFER_S", "TRIM_SLACK_S", "InputBuffer"]

MAX_BUFFER_S = 120
"""Input audio a turn keeps at least (at most `MAX_BUFFER_S + TRIM_SLACK_S`); older audio is dropped (a
turn that never ends)."""
TRIM_SLACK_S = 10
"""How far the buffer may grow past `MAX_BUFFER_S` before it is trimmed back to it."""
_PER_MS = SPEECH_RATE // 1000


class InputBuffer:
    def __init__(self, rate: int) -> None:
        self.rate = rate
        """The input's rate (what `append` takes)."""
        self.num_samples = 0
        """Input samples received in all: the timeline's end is `now_ms`."""
        self._resampler = None if rate == SPEECH_RATE else AlignedResampler(rate, SPEECH_RATE)
        """16 kHz sample i is at i / 16 ms on the timeline."""
        self._chunks: list[npt.NDArray[np.int16]] = []
        self._start = 0
        """16 kHz index on the timeline of the first buffered sample..."""
        self._end = 0
        """...and of the next one to arrive (`_start` > `_end` after a cut past the audio so far: the
        samples before `_start` are dropped as they come)."""

    @property
    def now_ms(self) -> int:
        return self.num_samples * 1000 // self.rate

    @property
    def start_ms(self) -> int:
        """Input timeline position of the first buffered sample."""
        return self._start // _PER_MS

    def append(self, pcm16: npt.NDArray[np.int16]) -> npt.NDArray[np.int16]:
        """Buffer the next input chunk (int16 at `rate`); returns it at 16 kHz (`pcm16` itself at 16 kHz)."""
        self.num_samples += pcm16.size
        speech = pcm16
        if self._resampler is not None:
            speech = float32_to_pcm16(self._resampler.process(pcm16_to_float32(pcm16)))
        kept = speech[max(0, self._start - self._end):]
        self._end += speech.size
        if kept.size:
            self._chunks.append(kept)
        # NOTE: the length comes from the indices (not a pass over the chunks for every chunk) and the trim
        # leaves TRIM_SLACK_S of room: a turn that never ends (an open line nobody speaks on) costs one copy of
        # the buffer per TRIM_SLACK_S instead of one per 20 ms chunk.
        if self._end - self._start > (MAX_BUFFER_S + TRIM_SLACK_S) * SPEECH_RATE:
            pcm = np.concatenate(self._chunks)[-MAX_BUFFER_S * SPEECH_RATE:].copy()  # NOTE: a copy frees the rest
            self._chunks, self._start = [pcm], self._end - pcm.size
        return speech

    def take(self, start_ms: int, end_ms: int) -> npt.NDArray[np.float32]:
        """The audio between two timeline positions, as float32 at 16 kHz; the buffer restarts at `end_ms`."""
        pcm = self._joined()
        first = max(0, start_ms * _PER_MS - self._start)
        last = max(first, end_ms * _PER_MS - self._start)
        rest = pcm[last:]
        self._chunks = [rest] if rest.size else []
        self._start = max(self._start, end_ms * _PER_MS)
        return pcm16_to_float32(pcm[first:last])

    def peek(self, start_ms: int) -> npt.NDArray[np.int16]:
        """The audio from `start_ms` to now, int16 at 16 kHz (the buffer is left as it is)."""
        return self._joined()[max(0, start_ms * _PER_MS - self._start):]

    def clear(self) -> None:
        """Drop what is buffered; the timeline goes on."""
        self._chunks, self._start = [], max(self._start, self.now_ms * _PER_MS)

    def _joined(self) -> npt.NDArray[np.int16]:
        return np.concatenate(self._chunks) if self._chunks else np.zeros(0, np.int16)
