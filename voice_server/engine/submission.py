"""The sending half of `Coordinator.submit`: a client's request, then its streamed input, on their way to
the entry stage.

Each message is encoded before anything is sent, so a refusal sends nothing: OverloadError when a bounded
resource is exhausted (retry later), RequestError when the payload cannot be encoded. Split from the
coordinator, which decides whether a request is admitted at all; this is how its messages leave.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import zmq

from voice_server.engine import ipc
from voice_server.engine.messages import Codec, Message, StreamChunk, StreamDone
from voice_server.engine.outbox import Outbox
from voice_server.engine.requests import OverloadError, RequestError
from voice_server.relay.shm import RelayFullError, is_exhaustion


def encode_for(peers: ipc.Peers, codec: Codec, process: str, msg: Message, what: str) -> tuple[zmq.Socket, bytes]:
    """The socket to `process` and `msg` encoded for it; `what` names the message in a RequestError."""
    try:
        # NOTE: the socket first: once encoded, relay slots are taken and the send must not fail.
        sock = peers.get(process)
    except zmq.ZMQError as exc:
        raise OverloadError(f"server busy: {exc}") from exc
    try:
        return sock, codec.encode(msg, consumer=process)
    except (RelayFullError, OSError, TypeError, ValueError, OverflowError) as exc:
        # NOTE: pack frees its relay slots itself
        if is_exhaustion(exc):
            raise OverloadError(f"server busy: {exc}") from exc
        raise RequestError(f"{what} cannot be sent: {exc}") from exc


class InputSender:
    """Every session's streamed input (`InputStream`) to the entry stages, sent once per event-loop turn."""

    def __init__(
        self, peers: ipc.Peers, codec: Codec, outbox: Outbox, loop: asyncio.AbstractEventLoop,
        is_stopping: Callable[[], bool],
    ) -> None:
        self._peers, self.codec, self.outbox, self._loop = peers, codec, outbox, loop
        self._is_stopping = is_stopping

    def send(self, msg: StreamChunk | StreamDone, process: str, is_live: Callable[[], bool]) -> bool:
        """One piece of a client's streamed input to the entry stage's `process` (the request's replica of it);
        False once the request has ended."""
        if self._is_stopping() or not is_live():
            # NOTE: nothing is encoded, so no relay slot is taken for a request the stages dropped;
            # chunks already sent are acked by the entry stage (held until the request leaves it,
            # or at once when they arrive after its abort).
            return False
        # NOTE: the socket is connected now, so that the flush cannot fail on it.
        _, data = encode_for(self._peers, self.codec, process, msg, "input chunk")
        # NOTE: the pieces every session sends in one loop turn go to a stage as one multipart message (each
        # user's 20 ms frames were one message each); the request's NewRequest went before, on this socket.
        if self.outbox.is_empty:
            self._loop.call_soon(self._flush)
        self.outbox.queue(process, data)
        return True

    def _flush(self) -> None:
        if not self._is_stopping():  # NOTE: the sockets are going; the stages drop the requests anyway
            self.outbox.flush()
