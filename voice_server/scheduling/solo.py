"""`SoloQueue`: every scheduler's policy for a batch whose step raised (the shell calls `fail`).

One bad request must not fail the requests batched with it. So when a failed batch held several live
requests, none fails yet: each member is queued to re-run alone, before anything else, and only a
request whose solo step raises gets the error (a batch of one fails its request at once). Re-running
is safe because a step that raised changed nothing a rerun depends on: a scheduler moves a request on
only in `update`, and a runner that keeps per-request state either commits it once the whole step
succeeded (`DecoderRunner`, `TalkerRunner`, `Code2WavRunner`) or fails its requests itself rather than
raise (`AsrRunner`).

A member is whatever the scheduler re-runs: the work items of one request (simple), one chunk
(code2wav), or a request id whose next step is planned afresh when its turn comes (ar).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence
from typing import Generic, TypeVar

MemberT = TypeVar("MemberT")


class SoloQueue(Generic[MemberT]):
    """Members of failed batches, each to run alone, in batch order, ahead of any other work."""

    def __init__(self, request_id_of: Callable[[MemberT], str]) -> None:
        self._request_id_of = request_id_of
        self._queue: deque[MemberT] = deque()

    def defer(self, members: Sequence[MemberT]) -> bool:
        """Queue the live members of a failed batch (one per request) to run alone: True when there are
        several (nobody fails yet); False for one or none, which the scheduler fails at once."""
        if len(members) <= 1:
            return False
        self._queue.extendleft(reversed(members))
        return True

    def pop(self) -> MemberT | None:
        """The next member to run alone (None: none is queued)."""
        return self._queue.popleft() if self._queue else None

    def discard(self, request_id: str) -> None:
        """Forget a request that left the stage (aborted or failed)."""
        self._queue = deque(m for m in self._queue if self._request_id_of(m) != request_id)

    def __bool__(self) -> bool:
        return bool(self._queue)
