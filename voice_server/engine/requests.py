"""What a client gets back from `Coordinator.submit`: terminal outputs in arrival order, as an
async iterator that ends on the request's last output, on abort, or with a RequestError.

The errors are typed so the session layer can answer each the right way: OverloadError and
UnavailableError mean "try again later" (WebSocket close 1013), the others end one request.
The coordinator's side of the same requests (in flight, queued outputs, deadlines) is `request_table.py`.
"""

from __future__ import annotations

import asyncio
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

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
