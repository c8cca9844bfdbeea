"""`OutputQueue`: a request's terminal outputs waiting for its consumer, audio coalesced while it lags.

Split from the request table (`request_table.py`), which only opens one per request and bounds it: what a
put adds (a new item, or audio joined to the last one) is this queue's own rule.
"""

from __future__ import annotations

import asyncio
from collections import deque
from typing import Any

import numpy as np

from voice_server.engine.requests import TerminalOutput

_AUDIO_KEYS = frozenset({"pcm", "sample_rate"})


class OutputQueue(asyncio.Queue[Any]):
    """A request's outputs waiting for its consumer, coalescing audio for a consumer that lags.

    An audio chunk (a stream output of only `pcm` and `sample_rate`) that arrives while the last
    queued output is an unread audio chunk of the same stage joins it: a consumer that falls behind
    (a slow client socket) gets fewer, longer chunks instead of a backlog of messages, and
    `max_queued_outputs` bounds what it must still handle one by one. Text and final outputs never
    merge, so their order with the audio is kept.
    """

    # NOTE: asyncio.Queue's storage hooks (`_init`, `_get`, `_put`) are how LifoQueue and
    # PriorityQueue change its order; this one changes what a put adds.
    def _init(self, maxsize: int) -> None:
        self._items: deque[Any] = deque()

    def _get(self) -> Any:
        return self._items.popleft()

    def _put(self, item: Any) -> None:
        joined = _join_audio(self._items[-1], item) if self._items else None
        if joined is None:
            self._items.append(item)
        else:
            self._items[-1] = joined

    def qsize(self) -> int:
        return len(self._items)

    def empty(self) -> bool:
        return not self._items


def _join_audio(first: Any, second: Any) -> TerminalOutput | None:
    """One output holding both audio chunks, or None if they must stay apart."""
    if not (isinstance(first, TerminalOutput) and isinstance(second, TerminalOutput)):
        return None
    if first.is_final or second.is_final or first.stage != second.stage:
        return None
    a, b = first.payload, second.payload
    if set(a) != _AUDIO_KEYS or set(b) != _AUDIO_KEYS or a["sample_rate"] != b["sample_rate"]:
        return None
    pcm_a, pcm_b = a["pcm"], b["pcm"]
    if not (isinstance(pcm_a, np.ndarray) and isinstance(pcm_b, np.ndarray)) or pcm_a.ndim != 1 \
            or pcm_b.ndim != 1 or pcm_a.dtype != pcm_b.dtype:
        return None
    # NOTE: the earlier chunk's timings: they are first-output stamps, set by then.
    return TerminalOutput(first.request_id, first.stage, {"pcm": np.concatenate([pcm_a, pcm_b]),
                                                          "sample_rate": a["sample_rate"]}, False, first.timings)
