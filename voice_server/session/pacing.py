"""`Pacer`: a connection's outgoing messages in order, each piece of audio sent when the client's playout
has room for it under `lead_s` (what the client holds never exceeds `lead_s`), for protocols whose clients
cannot pause (`/v1/realtime`, `/twilio/media`).

Why: the pipeline makes a reply far faster than real time (a clause of 2 s in ~30 ms), and a client that
has it all queued plays it all. A server that paces its sends keeps the client's queue at about
`lead_s`, so holding a reply (speech over it being judged, `ResponsePaused`) silences it within
`lead_s`, and a confirmed barge-in drops what was not sent (`flush`) instead of asking the client to.

The playout model is `PlayoutClock`'s: a message of `duration_s` plays from max(its send time, the end of
what was sent before). Messages without audio (`duration_s` 0) go as soon as the ones before them have
gone, so the order the session emitted is the order on the wire. While paused nothing goes.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import deque
from collections.abc import Awaitable, Callable
from typing import Generic, TypeVar

__all__ = ["DEFAULT_LEAD_S", "Pacer"]

M = TypeVar("M")

DEFAULT_LEAD_S = 0.12
"""Most audio a client holds ahead (between this less one piece and this): enough for a network's jitter on
a good line, short enough that a reply held at a barge-in's first speech window (`ResponsePaused`,
tentative) goes quiet within 300 ms of the first word (Silero's 30-170 ms to that window + this)."""


async def _discard(message: object) -> None:
    """`send` of a closed pacer."""


class Pacer(Generic[M]):
    def __init__(self, send: Callable[[M], Awaitable[object]], lead_s: float = DEFAULT_LEAD_S) -> None:
        if not 0.0 <= lead_s <= 10.0:
            raise ValueError(f"lead_s must be in [0, 10], got {lead_s!r}")
        self._send, self.lead_s = send, lead_s
        self._queue: deque[tuple[M, float]] = deque()
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self.is_paused = False
        self.play_end_at = 0.0
        """When the client's playout reaches the end of what was sent (monotonic)."""
        self.dropped_s = 0.0

    @property
    def queued_s(self) -> float:
        return sum(duration for _, duration in self._queue)

    def put(self, message: M, duration_s: float = 0.0) -> None:
        """Queue `message` (carrying `duration_s` of audio, or none)."""
        self._queue.append((message, duration_s))
        self._wake.set()
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._pump())

    def pause(self) -> None:
        self.is_paused = True

    def resume(self) -> None:
        self.is_paused = False
        self._wake.set()

    def flush(self, is_dropped: Callable[[M], bool]) -> float:
        """Drop the queued messages `is_dropped` picks (the others keep their order) and resume; the
        seconds of audio dropped."""
        dropped_s = sum(duration for message, duration in self._queue if is_dropped(message))
        self._queue = deque(entry for entry in self._queue if not is_dropped(entry[0]))
        self.dropped_s += dropped_s
        self.resume()
        return dropped_s

    async def close(self) -> None:
        """Stop sending; whatever is queued is dropped. NOTE: the send callable (a bound method of the
        connection that owns this pacer) is let go: connection -> pacer -> connection would be a reference
        cycle, and a closed connection would wait for the cycle collector."""
        self._queue.clear()
        self._send = _discard
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None

    async def _pump(self) -> None:
        while self._queue:
            if self.is_paused:
                await self._sleep(None)
                continue
            message, duration_s = self._queue[0]
            now = time.monotonic()
            # NOTE: the client holds at most `lead_s` once this piece is in (a piece longer than that goes
            # when the client has nothing left), so a hold silences the reply within `lead_s`.
            wait_s = self.play_end_at - now - max(0.0, self.lead_s - duration_s)
            if duration_s and wait_s > 0:
                await self._sleep(wait_s)
                continue
            self._queue.popleft()
            if duration_s:
                self.play_end_at = max(now, self.play_end_at) + duration_s
            await self._send(message)

    async def _sleep(self, timeout_s: float | None) -> None:
        """Until `timeout_s` passes or anything changes (a put, a resume, a flush)."""
        self._wake.clear()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._wake.wait(), timeout_s)
