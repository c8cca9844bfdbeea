"""What the caller has actually heard of the audio sent to Twilio, from the marks Twilio echoes.

Twilio plays the audio we send in order, and echoes a ``mark`` once everything sent before it has played.
``PlaybackTracker`` counts audio in 8 kHz samples (one mu-law byte each) on one timeline, asks for a
mark after every ``mark_interval_ms`` of audio (every 20 ms frame by default) and moves ``played_ms``
to a mark's position when its echo comes back.

The played-audio rule (conservative: ``played_ms`` never exceeds what played):

- Only echoes of marks that were pending when they came back, and not cleared, move ``played_ms``;
  echoes of names we never sent (or already saw) are ignored.
- ``on_clear`` (barge-in, sent with a Twilio ``clear``) drops everything not yet confirmed: Twilio
  discards its buffer and echoes every pending mark at once, and such an echo cannot be told from one
  whose audio played. So every mark pending at the clear is written off: its echo, whenever it comes,
  moves nothing. What was heard of the interrupted response is frozen at the last echo received
  before the clear.
- Error bound: the true played position exceeds ``played_ms`` by at most one mark interval (the audio
  after the last echoed mark) plus the echo's transit from Twilio (a mark whose echo is in flight at a
  clear counts as unplayed). It never falls below it. Twilio's "played" is its media server's: the
  carrier and handset jitter buffers behind it (tens of ms) are not seen by any Twilio signal.

NOTE: the alternative, the Twilio + OpenAI reference app's ``latest inbound media.timestamp -
response start``, is Twilio's wall clock since the response began, not audio played: it overcounts
whenever playback stalls (audio generated slower than real time, or a network hiccup) and is not capped
by what was sent. Marks cost one small frame per 20 ms and are exact to the interval.

Positions are on the "kept" timeline: audio sent minus audio dropped by clears, so after a clear the
next audio continues from ``played_ms``. ``start_response`` records where a response's audio begins;
``audio_end_ms`` is how much of it was heard (OpenAI's ``conversation.item.truncate`` field). Plain
Python and deterministic: mark names are ``<prefix><n>`` with n counting from 1.
"""

from __future__ import annotations

from collections import OrderedDict

__all__ = ["PlaybackTracker"]

SAMPLES_PER_MS = 8  # NOTE: Twilio audio is 8 kHz mu-law: one byte is one sample is 1/8 ms
# NOTE: Twilio buffers at most 10 minutes of audio; a mark per 20 ms of it is 30,000 marks.
DEFAULT_MAX_PENDING_MARKS = 30_000


class PlaybackTracker:
    """The sent/played accounting of one Twilio stream (one tracker per stream)."""

    def __init__(
        self,
        *,
        mark_interval_ms: float = 20.0,
        max_pending_marks: int = DEFAULT_MAX_PENDING_MARKS,
        mark_prefix: str = "vs",
    ) -> None:
        if isinstance(mark_interval_ms, bool) or not isinstance(mark_interval_ms, int | float) or not (
            mark_interval_ms > 0
        ):
            raise ValueError(f"mark_interval_ms must be a number > 0, got {mark_interval_ms!r}")
        if isinstance(max_pending_marks, bool) or not isinstance(max_pending_marks, int) or max_pending_marks < 1:
            raise ValueError(f"max_pending_marks must be an integer >= 1, got {max_pending_marks!r}")
        if not isinstance(mark_prefix, str) or not mark_prefix:
            raise ValueError("mark_prefix must be a non-empty string")
        self._num_mark_interval_samples = max(1, round(mark_interval_ms * SAMPLES_PER_MS))
        self._max_pending_marks = max_pending_marks
        self._mark_prefix = mark_prefix
        self._num_sent = 0  # every sample sent, dropped ones included
        self._num_dropped = 0  # samples written off by clears
        self._num_played = 0  # kept-timeline position confirmed played
        self._num_marked = 0  # kept-timeline position of the newest mark sent
        self._num_marks_sent = 0
        # NOTE: name -> (kept-timeline position, is_cleared), in sending order, so eviction drops the oldest.
        self._pending: OrderedDict[str, tuple[int, bool]] = OrderedDict()
        self._response_start: int | None = None
        self._response_end: int | None = None  # set by a clear: the response can no longer grow
        self.num_unknown_marks = 0
        self.num_cleared_marks = 0

    @property
    def _num_kept(self) -> int:
        return self._num_sent - self._num_dropped

    @property
    def sent_ms(self) -> float:
        """All audio sent to Twilio, dropped audio included."""
        return self._num_sent / SAMPLES_PER_MS

    @property
    def played_ms(self) -> float:
        """Audio confirmed played (the rule in the module docstring); never more than ``sent_ms``."""
        return self._num_played / SAMPLES_PER_MS

    @property
    def dropped_ms(self) -> float:
        """Audio sent but written off by clears (some of it may have played: the conservative side)."""
        return self._num_dropped / SAMPLES_PER_MS

    @property
    def queued_ms(self) -> float:
        """Audio sent, not dropped and not yet confirmed played (Twilio buffers at most 10 minutes)."""
        return (self._num_kept - self._num_played) / SAMPLES_PER_MS

    @property
    def num_pending_marks(self) -> int:
        """Marks sent whose echo has not come back, cleared ones included."""
        return len(self._pending)

    @property
    def response_start_ms(self) -> float | None:
        """Where the current response's audio begins on the kept timeline (None before any response)."""
        return None if self._response_start is None else self._response_start / SAMPLES_PER_MS

    @property
    def audio_end_ms(self) -> float:
        """How much of the current response the caller has heard (0.0 before any response)."""
        if self._response_start is None:
            return 0.0
        end = self._num_kept if self._response_end is None else self._response_end
        heard = min(max(self._num_played, self._response_start), end) - self._response_start
        return max(heard, 0) / SAMPLES_PER_MS

    def start_response(self) -> None:
        """The audio sent from now on belongs to a new response (call before sending its first frame)."""
        self._response_start = self._num_kept
        self._response_end = None

    def on_media_sent(self, num_samples: int) -> str | None:
        """Count a ``media`` frame of ``num_samples`` mu-law bytes just sent; a mark name if one is due.

        The caller sends ``build_mark_message(stream_sid, name)`` right after the media frame.
        """
        if isinstance(num_samples, bool) or not isinstance(num_samples, int) or num_samples < 0:
            raise ValueError(f"num_samples must be an integer >= 0, got {num_samples!r}")
        self._num_sent += num_samples
        if self._num_kept - self._num_marked >= self._num_mark_interval_samples:
            return self._new_mark()
        return None

    def mark_now(self) -> str | None:
        """A mark for the audio sent since the last one (e.g. a response's short last frame), if any."""
        return self._new_mark() if self._num_kept > self._num_marked else None

    def on_mark(self, name: str) -> bool:
        """Twilio echoed mark ``name``; True when it moved ``played_ms`` (unknown and cleared: False)."""
        entry = self._pending.pop(name, None)
        if entry is None:
            self.num_unknown_marks += 1
            return False
        position, is_cleared = entry
        if is_cleared:
            self.num_cleared_marks += 1
            return False
        is_advanced = position > self._num_played
        # NOTE: the max: Twilio echoes in order, but an earlier mark arriving late must not move back.
        self._num_played = max(self._num_played, position)
        return is_advanced

    def on_clear(self) -> float:
        """The session sent ``clear``: write off unconfirmed audio and pending marks; returns ``audio_end_ms``."""
        audio_end_ms = self.audio_end_ms
        for name, (position, _) in self._pending.items():
            self._pending[name] = (position, True)
        self._num_dropped += self._num_kept - self._num_played
        self._num_marked = self._num_kept  # == played: the new audio starts on a clean slate
        if self._response_start is not None:
            # NOTE: a response whose audio was all dropped may start past the rewound timeline: pull it
            # back so its span stays inside what was kept, and freeze it at what was heard.
            self._response_start = min(self._response_start, self._num_kept)
            self._response_end = self._response_start + round(audio_end_ms * SAMPLES_PER_MS)
        return audio_end_ms

    def _new_mark(self) -> str:
        self._num_marks_sent += 1
        name = f"{self._mark_prefix}{self._num_marks_sent}"
        self._pending[name] = (self._num_kept, False)
        self._num_marked = self._num_kept
        if len(self._pending) > self._max_pending_marks:
            # NOTE: a client that never echoes must not grow memory; losing the oldest mark only
            # delays played_ms to the next echo (the conservative side).
            self._pending.popitem(last=False)
        return name
