"""`RequestTable`: the coordinator's record of the requests in flight, and every way one ends.

Split from `requests.py`, which holds what a client sees of a request (its stream, its input, its errors):
this is the coordinator's side, which feeds those streams and decides when a request is over.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from voice_server.engine.output_queue import OutputQueue
from voice_server.engine.requests import (
    DeadlineExceeded,
    RequestError,
    RequestStream,
    SlowConsumerError,
    TerminalOutput,
)


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
        on_end: Callable[[str], None] | None = None,
    ) -> None:
        if isinstance(max_queued_outputs, bool) or not isinstance(max_queued_outputs, int) or max_queued_outputs < 1:
            raise ValueError(f"max_queued_outputs: must be an integer >= 1, got {max_queued_outputs!r}")
        self._loop, self._terminal_stages, self._broadcast_abort = loop, terminal_stages, broadcast_abort
        self.max_queued_outputs = max_queued_outputs
        self._requests: dict[str, RequestState] = {}
        self._on_end = on_end
        """Told each request id that ended, however it ended (the replica planner's loads)."""
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
        self.fail_some(list(self._requests), error)

    def fail_some(self, request_ids: list[str], error: RequestError) -> None:
        """Fail those of `request_ids` still in flight, with one abort broadcast for all of them."""
        failed = [rid for rid in request_ids if self._end(rid, error)]
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
        if self._on_end is not None:
            self._on_end(request_id)
        return True

    def _expire(self, request_id: str, timeout_s: float) -> None:
        self.fail(request_id, DeadlineExceeded(f"request exceeded its deadline of {timeout_s:g} s"))

    def _abandon(self, request_id: str) -> None:
        """A stream was garbage collected unfinished; may run on any thread."""
        if self.is_closed or self._loop.is_closed():
            return
        with contextlib.suppress(RuntimeError):  # NOTE: the loop closed meanwhile: nothing left to abort
            self._loop.call_soon_threadsafe(self.abort, request_id)


def _drain(queue: asyncio.Queue[Any]) -> None:
    while not queue.empty():
        queue.get_nowait()
