"""What a client gets back from `Coordinator.submit`: terminal outputs in arrival order, as an
async iterator that ends on the request's last output, on abort, or with a RequestError."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from voice_server.engine.coordinator import Coordinator


class RequestError(RuntimeError):
    """A request failed in some stage (bad input, a stage error, a dead stage process)."""


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


class RequestStream:
    """Async iterator over one request's terminal outputs; raises RequestError on failure.

    Leaving the iteration early (`aclose`, or the consumer going away) aborts the request.
    """

    def __init__(self, coordinator: Coordinator, request_id: str, queue: asyncio.Queue[Any]) -> None:
        self.coordinator, self.request_id, self._queue = coordinator, request_id, queue
        self.is_done = False

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> TerminalOutput:
        if self.is_done:
            raise StopAsyncIteration
        item = await self._queue.get()
        if isinstance(item, TerminalOutput):
            return item
        self.is_done = True
        if isinstance(item, RequestError):
            raise item
        raise StopAsyncIteration

    async def aclose(self) -> None:
        if not self.is_done:
            self.is_done = True
            await self.coordinator.abort(self.request_id)
