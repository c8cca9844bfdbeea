"""Audibility: frame levels, and when a listener first hears a response (`PlayoutClock`).

"First audio" is what a person hears, not the first byte: a reply whose first chunk opens with 300 ms
of near-silence is heard 300 ms later than it is sent. A 10 ms frame is audible when its RMS level is
at least `AUDIBLE_DB` (-40 dBFS: speech at a normal level sits 20-30 dB above it; a synthesiser's
fade-in and the noise floor below it).

`PlayoutClock` models the client as the protocols define it: each chunk is played when it arrives or
when the audio queued before it ends, whichever is later (a playout buffer with no added delay), so
the moment a frame is heard is known on the server from the send times alone.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

__all__ = ["AUDIBLE_DB", "FRAME_MS", "PlayoutClock", "frame_levels_db"]

AUDIBLE_DB = -40.0
FRAME_MS = 10


Samples = npt.NDArray[np.float32] | npt.NDArray[np.int16] | npt.NDArray[np.float64]


def _as_float(samples: Samples) -> npt.NDArray[np.float64]:
    scale = 32768.0 if samples.dtype == np.int16 else 1.0
    return np.asarray(samples, dtype=np.float64).reshape(-1) / scale


def frame_levels_db(samples: Samples, rate: int, frame_ms: int = FRAME_MS) -> npt.NDArray[np.float64]:
    """RMS level (dBFS) of each `frame_ms` frame (int16 or float32 mono); a partial last frame is a frame
    of its own, its mean taken over its real samples so that a loud ending is not diluted."""
    pcm = _as_float(samples)
    frame_len = rate * frame_ms // 1000
    num_frames = -(-pcm.size // frame_len)
    padded = np.zeros(num_frames * frame_len, np.float64)
    padded[: pcm.size] = pcm
    counts = np.full(num_frames, frame_len, np.float64)
    if num_frames and pcm.size % frame_len:
        counts[-1] = pcm.size % frame_len
    power = (padded.reshape(num_frames, frame_len) ** 2).sum(axis=1) / counts
    return 10.0 * np.log10(np.maximum(power, 1e-20))


class PlayoutClock:
    """When the audio sent so far is heard (see the module docstring); times are `time.monotonic()`s."""

    def __init__(self, rate: int, level_db: float = AUDIBLE_DB) -> None:
        self.rate, self.level_db = rate, level_db
        self._frame_len = rate * FRAME_MS // 1000
        self.first_byte_at: float | None = None
        self.first_audible_at: float | None = None
        self.play_end_at = 0.0
        """When playback reaches the end of what was sent."""
        self._carry = np.zeros(0, np.float64)
        """The stream's last partial frame, judged when the next chunk completes it."""
        self._carry_at = 0.0

    def sent(self, samples: npt.NDArray[np.float32] | npt.NDArray[np.int16], now: float) -> None:
        """A chunk handed to the client at `now`."""
        if samples.size == 0:
            return
        if self.first_byte_at is None:
            self.first_byte_at = now
        start = max(now, self.play_end_at)
        self.play_end_at = start + samples.size / self.rate
        if self.first_audible_at is not None:
            return
        num_carried = self._carry.size
        pcm = np.concatenate((self._carry, _as_float(samples)))
        num_whole = pcm.size // self._frame_len * self._frame_len
        loud = np.flatnonzero(frame_levels_db(pcm[:num_whole], self.rate) >= self.level_db)
        if loud.size:
            at = int(loud[0]) * self._frame_len
            self.first_audible_at = (self._carry_at + at / self.rate if at < num_carried
                                     else start + (at - num_carried) / self.rate)
            return
        self._carry = pcm[num_whole:]
        self._carry_at = (self._carry_at + num_whole / self.rate if num_whole < num_carried
                          else start + (num_whole - num_carried) / self.rate)
