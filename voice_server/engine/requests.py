"""What a client gets back from `Coordinator.submit`: terminal outputs in arrival order, as an
async iterator that ends on the request's last output, on abort, or with a RequestError.

The errors are typed so the session layer can answer each the right way: OverloadError and
UnavailableError mean "try again later" (WebSocket close 1013), the others end one request.
"""

from __future__ import annotations

import asyncio
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


class RequestError(RuntimeError):
    """A request failed in some stage (bad input, a stage error, a dead stage process)."""


class OverloadError(RequestError):
    """Refused (or ended) because a bounded resource is exhausted: requests in flight, relay bytes or
    segments, descriptors. Nothing is wrong with the request; retry later."""


class UnavailableError(RequestError):
    """The pipeline cannot serve right now (a stage process is restarting or the server stops)."""


class DeadlineExceeded(RequestError):
    """The request ran past its deadline; it was aborted everywhere."""


@dataclass(frozen=True)
class TerminalOutput:
    request_id: str
    stage: str
    payload: dict[str, Any]
    is_final: bool
    """The last output of this stage for the request."""


@dataclass
class RequestState:
    queue: asyncio.Queue[TerminalOutput | RequestError | None]
    pending_terminals: set[str]
    deadline: asyncio.TimerHandle | None = None


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
