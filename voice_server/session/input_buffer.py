"""`InputBuffer`: a session's input audio since the last committed turn, on the input timeline.

Times are ms of the session's input timeline (all audio received since the session started, as
OpenAI's `audio_start_ms` / `audio_end_ms`); the turn detectors report in the same times, so a turn's
audio is cut from here by its event times and no audio is copied twice.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

from voice_server.audio import pcm16_to_float32

__all__ = ["MAX_BUFFER_S", "TRIM_SLACK_S", "InputBuffer"]

MAX_BUFFER_S = 120
"""Input audio a turn keeps at least (at most `MAX_BUFFER_S + TRIM_SLACK_S`); older audio is dropped (a
turn that never ends)."""
TRIM_SLACK_S = 10
"""How far the buffer may grow past `MAX_BUFFER_S` before it is trimmed back to it."""


class InputBuffer:
    def __init__(self, rate: int) -> None:
        self.rate = rate
        self._chunks: list[npt.NDArray[np.int16]] = []
        self.start_ms = 0
        """Input timeline position of the first buffered sample."""
        self.num_samples = 0
        """Samples received in all: the timeline's end is `now_ms`."""

    @property
    def now_ms(self) -> int:
        return self.num_samples * 1000 // self.rate

    def append(self, pcm16: npt.NDArray[np.int16]) -> None:
        self._chunks.append(pcm16)
        self.num_samples += pcm16.size
        # NOTE: the length comes from the timeline (not a pass over the chunks for every chunk) and the
        # trim leaves TRIM_SLACK_S of room: a turn that never ends (an open line nobody speaks on) costs
        # one copy of the buffer per TRIM_SLACK_S instead of one per 20 ms chunk.
        if self.now_ms - self.start_ms > (MAX_BUFFER_S + TRIM_SLACK_S) * 1000:
            pcm = np.concatenate(self._chunks)[-MAX_BUFFER_S * self.rate:].copy()  # NOTE: a copy frees the rest
            self._chunks = [pcm]
            self.start_ms = (self.num_samples - pcm.size) * 1000 // self.rate

    def take(self, start_ms: int, end_ms: int) -> npt.NDArray[np.float32]:
        """The audio between two timeline positions, as float32; the buffer restarts at `end_ms`."""
        pcm = self._joined()
        first = max(0, (start_ms - self.start_ms) * self.rate // 1000)
        last = max(first, (end_ms - self.start_ms) * self.rate // 1000)
        rest = pcm[last:]
        self._chunks = [rest] if rest.size else []
        self.start_ms = end_ms
        return pcm16_to_float32(pcm[first:last])

    def peek(self, start_ms: int) -> npt.NDArray[np.int16]:
        """The audio from `start_ms` to now (the buffer is left as it is)."""
        return self._joined()[max(0, (start_ms - self.start_ms) * self.rate // 1000):]

    def clear(self) -> None:
        """Drop what is buffered; the timeline goes on."""
        self._chunks, self.start_ms = [], self.now_ms

    def _joined(self) -> npt.NDArray[np.int16]:
        return np.concatenate(self._chunks) if self._chunks else np.zeros(0, np.int16)
