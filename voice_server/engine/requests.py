"""What a client gets back from `Coordinator.submit`: terminal outputs in arrival order, as an
async iterator that ends on the request's last output, on abort, or with a RequestError.

The errors are typed so the session layer can answer each the right way: OverloadError and
UnavailableError mean "try again later" (WebSocket close 1013), the others end one request.
"""

from __future__ import annotations

import asyncio
import contextlib
import weakref
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from voice_server.engine.messages import StreamChunk, StreamDone


class RequestError(RuntimeError):
    """A request failed in some stage (bad input, a stage error, a dead stage process)."""


class OverloadError(RequestError):
    """Refused (or ended) because a bounded resource is exhausted: requests in flight, relay bytes or
    segments, descriptors. Nothing is wrong with the request; retry later."""


class UnavailableError(RequestError):
    """The pipeline cannot serve right now (a stage process is restarting or the server stops)."""


class DeadlineExceeded(RequestError):
    """The request ran past its deadline; it was aborted everywhere."""


class SlowConsumerError(RequestError):
    """The request's consumer left more than `max_queued_outputs` outputs unread; it was aborted everywhere."""


@dataclass(frozen=True)
class TerminalOutput:
    request_id: str
    stage: str
    payload: dict[str, Any]
    is_final: bool
    """The last output of this stage for the request."""
    timings: dict[str, float] = field(default_factory=dict)
    """`submit` and, for each stage this output passed through (the stage itself included), the
    CLOCK_MONOTONIC time of that stage's first output for the request: e.g. encoder done, thinker
    first token, talker first frame, code2wav first PCM chunk. Same clock as `time.monotonic()`."""


@dataclass
class RequestState:
    queue: asyncio.Queue[TerminalOutput | RequestError | None]
    pending_terminals: set[str]
    deadline: asyncio.TimerHandle | None = None


class RequestTable:
    """The requests in flight: their output queues, the terminal stages still to finish, deadlines.

    Every way a request ends goes through here (completed, failed, expired, aborted, abandoned by
    its consumer); `broadcast_abort` tells the stages to drop the ones that did not complete.
    """

    def __init__(
        self, loop: asyncio.AbstractEventLoop, terminal_stages: tuple[str, ...],
        broadcast_abort: Callable[[list[str]], None], max_queued_outputs: int = 1024,
    ) -> None:
        if isinstance(max_queued_outputs, bool) or not isinstance(max_queued_outputs, int) or max_queued_outputs < 1:
            raise ValueError(f"max_queued_outputs: must be an integer >= 1, got {max_queued_outputs!r}")
        self._loop, self._terminal_stages, self._broadcast_abort = loop, terminal_stages, broadcast_abort
        self.max_queued_outputs = max_queued_outputs
        self._requests: dict[str, RequestState] = {}
        self.is_closed = False

    def __len__(self) -> int:
        return len(self._requests)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._requests

    def open(self, request_id: str, timeout_s: float | None) -> RequestStream:
        queue: asyncio.Queue[TerminalOutput | RequestError | None] = OutputQueue()
        state = self._requests[request_id] = RequestState(queue, set(self._terminal_stages))
        if timeout_s is not None:
            state.deadline = self._loop.call_later(timeout_s, self._expire, request_id, timeout_s)
        return RequestStream(request_id, queue, self.abort, self._abandon)

    def deliver(self, output: TerminalOutput) -> bool:
        """Queue a terminal output for its consumer; False if that stage owes this request nothing."""
        request = self._requests.get(output.request_id)
        if request is None:
            return True  # NOTE: aborted or failed already; late outputs are expected
        if output.stage not in request.pending_terminals:
            return False
        if request.queue.qsize() >= self.max_queued_outputs:
            # NOTE: what is queued is dropped at once (the request failed; its consumer gets the error
            # next instead of after the backlog), so memory is bounded per request.
            _drain(request.queue)
            self.fail(output.request_id, SlowConsumerError(
                f"consumer too slow: {self.max_queued_outputs} outputs were queued unread (max_queued_outputs)"))
            return True
        request.queue.put_nowait(output)
        if output.is_final:
            request.pending_terminals.discard(output.stage)
            if not request.pending_terminals:
                self._end(output.request_id, None)
        return True

    def is_backlogged(self, request_id: str) -> bool:
        """Whether the request's consumer has half of `max_queued_outputs` or more to read."""
        request = self._requests.get(request_id)
        return request is not None and 2 * request.queue.qsize() >= self.max_queued_outputs

    def live_check(self, request_id: str) -> Callable[[], bool]:
        """Whether this very request is still in flight (not a later one that reuses its id)."""
        state = self._requests[request_id]
        return lambda: self._requests.get(request_id) is state

    def fail(self, request_id: str, error: RequestError) -> None:
        if self._end(request_id, error):
            self._broadcast_abort([request_id])  # other stages drop what they hold

    def fail_all(self, error: RequestError) -> None:
        failed = [rid for rid in list(self._requests) if self._end(rid, error)]
        if failed:
            self._broadcast_abort(failed)

    def abort(self, request_id: str) -> bool:
        """End a request quietly (barge-in, disconnect); False if it was not in flight."""
        request = self._requests.get(request_id)
        if request is None:
            return False
        _drain(request.queue)  # NOTE: after a barge-in nothing more may reach the client
        self._end(request_id, None)
        self._broadcast_abort([request_id])
        return True

    def _end(self, request_id: str, outcome: RequestError | None) -> bool:
        request = self._requests.pop(request_id, None)
        if request is None:
            return False
        if request.deadline is not None:
            request.deadline.cancel()
        request.queue.put_nowait(outcome)
        return True

    def _expire(self, request_id: str, timeout_s: float) -> None:
        self.fail(request_id, DeadlineExceeded(f"request exceeded its deadline of {timeout_s:g} s"))

    def _abandon(self, request_id: str) -> None:
        """A stream was garbage collected unfinished; may run on any thread."""
        if self.is_closed or self._loop.is_closed():
            return
        with contextlib.suppress(RuntimeError):  # NOTE: the loop closed meanwhile: nothing left to abort
            self._loop.call_soon_threadsafe(self.abort, request_id)


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


def _drain(queue: asyncio.Queue[Any]) -> None:
    while not queue.empty():
        queue.get_nowait()


class RequestStream:
    """Async iterator over one request's terminal outputs; raises RequestError on failure.

    Whenever the consumer goes away the request is aborted everywhere: `aclose()`, the consuming
    task cancelled while it waits, or the stream dropped unfinished (a `break` out of `async for`
    and the reference gone) — the last through a finalizer, since `async for` never closes it.
    """

    def __init__(
        self, request_id: str, queue: asyncio.Queue[Any], abort: Callable[[str], object],
        abandon: Callable[[str], None],
    ) -> None:
        self.request_id, self._queue, self._abort = request_id, queue, abort
        self.is_done = False
        self.input: InputStream | None = None
        """The request's streamed input (`submit(..., stream_input=True)`); None for a whole request."""
        self._finalizer = weakref.finalize(self, abandon, request_id)
        self._finalizer.atexit = False

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> TerminalOutput:
        if self.is_done:
            raise StopAsyncIteration
        try:
            item = await self._queue.get()
        except asyncio.CancelledError:
            self._close()
            raise
        if isinstance(item, TerminalOutput):
            return item
        self.is_done = True
        self._finalizer.detach()
        if isinstance(item, RequestError):
            raise item
        raise StopAsyncIteration

    def _close(self) -> None:
        if not self.is_done:
            self.is_done = True
            self._finalizer.detach()
            self._abort(self.request_id)

    async def aclose(self) -> None:
        self._close()


class InputStream:
    """The client side of a streamed request input: chunks to the entry stage, in order, then the end.

    `send(payload)` forwards one chunk as a `StreamChunk` (numbered for you; arrays go through the relay
    codec like any payload), `end()` closes the input with `StreamDone`. Call both on the coordinator's
    event loop; they return at once. Once the request has ended (completed, failed, expired, aborted) or
    its input was ended, they send nothing and return False: a session may still hold audio for a request
    that a barge-in or a stage failure just ended, and must not crash on it.

    Raises, with nothing sent and no chunk number used (so the input stays whole): RequestError when the
    payload is not a mapping with string keys or cannot be encoded, OverloadError when the relay is full
    (retry later, or abort the request).
    """

    def __init__(self, request_id: str, stage: str, send: Callable[[StreamChunk | StreamDone], bool]) -> None:
        self.request_id, self.stage, self._send = request_id, stage, send
        self.num_chunks = 0
        """Chunks sent so far (the next chunk's `seq`)."""
        self.is_ended = False

    def send(self, payload: dict[str, Any]) -> bool:
        if not isinstance(payload, dict) or not all(isinstance(k, str) for k in payload):
            raise RequestError(f"input chunk payload must be a mapping with string keys, got {type(payload).__name__}")
        if self.is_ended:
            return False
        if not self._send(StreamChunk(self.request_id, self.stage, self.num_chunks, payload)):
            self.is_ended = True
            return False
        self.num_chunks += 1
        return True

    def end(self) -> bool:
        if self.is_ended:
            return False
        self.is_ended = True
        return self._send(StreamDone(self.request_id, self.stage, self.num_chunks))
