"""`CoordinatorIntake`: what the coordinator does with each control message a stage process sends it.

Split from the coordinator, which launches, admits and stops: this is its receiving side, the loop on its
inbox and the dispatch by message type (outputs to their requests, failures, relay acks, start-up reports to
the supervisor, stats replies to whoever asked).
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import numpy as np
import zmq

from voice_server.engine.messages import (
    Ack,
    Codec,
    Failure,
    Message,
    MessageError,
    Output,
    Progress,
    Ready,
    SlabRef,
    StartupFailed,
    StatsReply,
)
from voice_server.engine.outbox import Outbox
from voice_server.engine.request_table import RequestTable
from voice_server.engine.requests import OverloadError, RequestError, TerminalOutput
from voice_server.engine.supervisor import Supervisor
from voice_server.relay.shm import ShmSlab

log = logging.getLogger("voice_server.coordinator")


class CoordinatorIntake:
    """`run` reads `sock` (a `zmq.asyncio` socket, typed as the plain one `ipc.configure` returns) until
    cancelled; the coordinator stops it with its other tasks."""

    def __init__(
        self, sock: zmq.Socket, codec: Codec, outbox: Outbox, requests: RequestTable,
        supervisor: Supervisor, slab: ShmSlab,
    ) -> None:
        self._sock, self.codec, self.outbox, self._requests = sock, codec, outbox, requests
        self.supervisor, self.slab = supervisor, slab
        self.num_dropped_messages = 0
        self.counters = {"num_messages_in": 0, "num_frames_in": 0}
        """ZMQ messages received from the stages, and the control messages (frames) in them."""
        self.stats_replies: dict[int, dict[str, StatsReply]] = {}
        """Per `StatsQuery` nonce still awaited, the replies so far by process."""

    async def run(self) -> None:
        while True:
            try:
                frames = await self._sock.recv_multipart()  # type: ignore[misc]  # zmq.asyncio: a future
            except zmq.ZMQError as exc:  # NOTE: e.g. EMFILE; keep serving once it clears
                log.error("coordinator inbox: %s", exc)
                await asyncio.sleep(0.1)
                continue
            self.counters["num_messages_in"] += 1
            self.counters["num_frames_in"] += len(frames)
            for data in frames:
                await self._handle(data)

    async def _handle(self, data: bytes) -> None:
        """One control message from a stage process (a frame of a multipart message)."""
        try:
            msg, refs = self.codec.decode(data)
        except MessageError as exc:
            self._drop(f"dropped a message: {exc}")
            self.outbox.ack(exc.refs)
            if exc.request_id is not None:
                error_cls = OverloadError if exc.is_overload else RequestError
                self._requests.fail(exc.request_id, error_cls(f"output of stage '{exc.stage}' lost: {exc}"))
            return
        try:
            self._dispatch(msg, refs)
        except Exception:
            self._drop(f"coordinator failed to handle {type(msg).__name__}", exc_info=True)
        if isinstance(msg, Output) and self._requests.is_backlogged(msg.request_id):
            # NOTE: a ready message is received without yielding, so a stage streaming faster than this
            # loop would keep the client from reading until its queue hit `max_queued_outputs`. Only
            # then: yielding on every message would hand the loop to every other task (a retry storm).
            await asyncio.sleep(0)

    def _drop(self, message: str, exc_info: bool = False) -> None:
        self.num_dropped_messages += 1
        log.warning(message, exc_info=exc_info)

    def _dispatch(self, msg: Message, refs: list[SlabRef]) -> None:
        if isinstance(msg, Output):
            # NOTE: the client may hold outputs indefinitely, so relay-backed arrays are copied and
            # their slots returned at once.
            payload = _detach(msg.payload) if refs else msg.payload
            self.outbox.ack(refs)
            output = TerminalOutput(msg.request_id, msg.stage, payload, msg.is_final, dict(msg.timings))
            if not self._requests.deliver(output):
                self._drop(f"dropped an Output of {msg.stage!r}, which is not a pending terminal stage")
            return
        self.outbox.ack(refs)
        if isinstance(msg, Failure):
            error_cls = OverloadError if msg.is_overload else RequestError
            self._requests.fail(msg.request_id, error_cls(f"stage '{msg.stage}': {msg.message}"))
        elif isinstance(msg, Ack):
            if msg.owner == self.slab.owner:
                self.slab.ack(msg.slot_ids)
        elif isinstance(msg, Ready):
            if not self.supervisor.on_ready(msg.process, msg.generation, msg.facts):
                self._drop(f"dropped a stale or foreign Ready from {msg.process!r}")
        elif isinstance(msg, Progress):
            self.supervisor.on_progress(msg.process, msg.generation, msg.stage, msg.phase)
        elif isinstance(msg, StartupFailed):
            if not self.supervisor.on_startup_failed(msg.process, msg.generation, msg.message):
                self._drop(f"dropped a stale or foreign StartupFailed from {msg.process!r}")
        elif isinstance(msg, StatsReply) and msg.nonce in self.stats_replies:
            self.stats_replies[msg.nonce][msg.process] = msg


def _detach(obj: Any) -> Any:
    """Copy every array out of relay memory."""
    if isinstance(obj, np.ndarray):
        return obj.copy()
    if isinstance(obj, dict):
        return {k: _detach(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_detach(v) for v in obj]
    return obj
