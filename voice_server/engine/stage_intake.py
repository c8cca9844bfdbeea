"""`StageIntake`: what a stage process does with each control message it receives, and the requests it dropped.

Split from the stage shell (`stage.py`), which runs the loop and routes what its stages emit: this is its
receiving side, draining a socket and dispatching by message type (work to its stage's scheduler, aborts,
relay acks, a peer's death, stats queries), with the record of the requests this process aborted or failed,
so that late messages for them are ignored.
"""

from __future__ import annotations

import itertools
import logging
import time
import traceback
from collections import OrderedDict
from typing import TYPE_CHECKING

import zmq

from voice_server.engine import ipc
from voice_server.engine.messages import (
    NUM_ABORTED_KEPT,
    Abort,
    Ack,
    Codec,
    Failure,
    Message,
    MessageError,
    NewRequest,
    PeerDown,
    PeerMoved,
    SlabRef,
    StatsQuery,
    StatsReply,
    StreamChunk,
    StreamDone,
)
from voice_server.engine.outbox import Outbox
from voice_server.engine.replicas import is_valid_plan
from voice_server.engine.runtime import StageRuntime
from voice_server.engine.transports import relay_counters
from voice_server.logs import rate_key
from voice_server.relay.shm import ShmReader, ShmSlab
from voice_server.scheduling import CapacityError, WorkItem, WorkKind

if TYPE_CHECKING:
    from voice_server.engine.process import ProcessSpec

log = logging.getLogger("voice_server.stage")
_MAX_DRAIN = 256
_NUM_ABORTS_REPORTED = 256


class StageIntake:
    """`stages` is the shell's own mapping, filled once the runners are built; the shell owns the sockets."""

    def __init__(
        self, spec: ProcessSpec, stages: dict[str, StageRuntime], codec: Codec, outbox: Outbox, slab: ShmSlab,
        reader: ShmReader, peers: ipc.Peers,
    ) -> None:
        self.spec, self.stages = spec, stages
        self.codec, self.outbox, self.slab, self.reader, self._peers = codec, outbox, slab, reader, peers
        self.num_dropped_messages = 0
        self.aborted: OrderedDict[str, float] = OrderedDict()
        """Recently aborted request ids -> when this process dropped them (late messages are ignored)."""
        self.io_counters = {"num_messages_in": 0, "num_frames_in": 0}
        """ZMQ messages received by this process, and the control messages (frames) in them."""

    def drain(self, sock: zmq.Socket) -> None:
        """Handle what is waiting on `sock` (at most `_MAX_DRAIN` ZMQ messages), without blocking."""
        for _ in range(_MAX_DRAIN):
            try:
                frames = sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            self.io_counters["num_messages_in"] += 1
            self.io_counters["num_frames_in"] += len(frames)
            for data in frames:
                self._dispatch_safely(data)

    def _dispatch_safely(self, data: bytes) -> None:
        try:
            self._dispatch(data)
        except Exception:  # NOTE: one bad message never takes the stage down
            self.num_dropped_messages += 1
            log.exception("dropped a message that could not be handled")

    def _decode(self, data: bytes) -> tuple[Message, list[SlabRef]] | None:
        try:
            return self.codec.decode(data)
        except MessageError as exc:
            self.num_dropped_messages += 1
            log.warning("dropped a message: %s", exc)
            self.outbox.ack(exc.refs)
            runtime = self.stages.get(exc.stage or "")
            if runtime is not None and exc.request_id is not None \
                    and exc.request_id in runtime.scheduler.active_request_ids:
                # NOTE: a work item that cannot be read would leave a hole in the request's stream.
                self.fail_request(runtime, exc.request_id, str(exc), exc.is_overload)
            return None

    def recv(self, sock: zmq.Socket) -> Message | None:
        """One message from `sock`, its relay slots acked, not dispatched; None if it could not be read."""
        decoded = self._decode(sock.recv())
        if decoded is None:
            return None
        self.outbox.ack(decoded[1])
        return decoded[0]

    def _dispatch(self, data: bytes) -> None:
        decoded = self._decode(data)
        if decoded is None:
            return
        msg, refs = decoded
        if isinstance(msg, (NewRequest, StreamChunk, StreamDone)):
            self._on_work(msg, refs)
            return
        self.outbox.ack(refs)
        if isinstance(msg, Ack):
            if msg.owner == self.slab.owner:
                self.slab.ack(msg.slot_ids)
        elif isinstance(msg, Abort):
            for request_id in msg.request_ids:
                self._abort(request_id)
        elif isinstance(msg, PeerDown):
            self.reader.forget_owner(msg.owner)
            self.slab.release_consumer(msg.process)
            self._peers.reset(msg.process)
        elif isinstance(msg, PeerMoved):
            self.spec.endpoints.move(msg.process, msg.address, msg.node)
            self._peers.reset(msg.process)
        elif isinstance(msg, StatsQuery):
            active = {name: sorted(s.scheduler.active_request_ids) for name, s in self.stages.items()}
            io = {**self.io_counters, **self.outbox.counters, **relay_counters(self.codec.slab, self.codec.reader)}
            counters = {name: {**s.scheduler.stats(), **s.runner.stats(), **io} for name, s in self.stages.items()}
            recent = dict(itertools.islice(reversed(self.aborted.items()), _NUM_ABORTS_REPORTED))
            self.outbox.send(ipc.COORDINATOR, StatsReply(
                self.spec.process, self.spec.generation, msg.nonce, active,
                self.slab.num_live_slots, self.slab.num_used_bytes, self.num_dropped_messages, recent, counters,
            ))

    def _on_work(self, msg: NewRequest | StreamChunk | StreamDone, refs: list[SlabRef]) -> None:
        runtime = self.stages.get(msg.stage)
        if runtime is None:
            self.num_dropped_messages += 1
            log.warning("dropped work for stage %r, which this process does not run", msg.stage)
            self.outbox.ack(refs)
            return
        if msg.request_id in self.aborted:
            self.outbox.ack(refs)
            return
        rid, now = msg.request_id, time.monotonic()
        if isinstance(msg, NewRequest):
            if rid in runtime.scheduler.active_request_ids:
                self.num_dropped_messages += 1
                log.warning("dropped a second NewRequest for %s", rid)
                self.outbox.ack(refs)
                return
            if not is_valid_plan(self.spec.pipeline, msg.replicas):
                # NOTE: its outputs would go to a process that does not run their stage (or none at all).
                self.num_dropped_messages += 1
                log.warning("dropped a NewRequest for %s with a foreign replica plan", rid)
                self.outbox.ack(refs)
                return
            if msg.replicas:
                runtime.replicas[rid] = msg.replicas
            runtime.params[rid] = msg.params
            runtime.num_chunks_received[rid] = 0
            runtime.timings[rid] = dict(msg.timings)
            item = WorkItem(rid, WorkKind.NEW, msg.payload, msg.params, is_stream=msg.is_stream)
        elif rid not in runtime.scheduler.active_request_ids:
            self.outbox.ack(refs)  # late chunk of a request that already left this stage
            return
        else:
            # NOTE: the shell checks each upstream stream is whole, so a request either completes
            # with every chunk or fails; it never "completes" with a hole.
            num_received = runtime.num_chunks_received.get(rid, 0)
            expected = msg.seq if isinstance(msg, StreamChunk) else msg.num_chunks
            if expected != num_received:
                self.outbox.ack(refs)
                self.fail_request(runtime, rid, f"upstream stream incomplete: expected chunk {num_received}, "
                                   f"got {'chunk' if isinstance(msg, StreamChunk) else 'end after'} {expected}",
                                   is_overload=False)
                return
            if isinstance(msg, StreamChunk):
                runtime.num_chunks_received[rid] = num_received + 1
                if msg.timings:
                    # NOTE: upstream stamps (e.g. the thinker's first token) reach a stream consumer
                    # with the chunks, which may come after its NewRequest.
                    runtime.timings.setdefault(rid, {}).update(msg.timings)
                item = WorkItem(rid, WorkKind.CHUNK, msg.payload, runtime.params.get(rid, {}), msg.seq)
            else:
                item = WorkItem(rid, WorkKind.DONE, {}, runtime.params.get(rid, {}), msg.num_chunks)
        runtime.held_refs.setdefault(rid, []).extend(refs)
        try:
            runtime.scheduler.add(runtime.runner.admit(item), now)
        except ValueError as exc:
            # NOTE: malformed input or params refuse this request alone, at admission; so does a stage
            # out of room for it (CapacityError), as a retryable overload.
            log.warning("stage %s: refused %s: %s", runtime.cfg.name, rid, exc,
                        extra=rate_key(f"stage {runtime.cfg.name}: refused: {type(exc).__name__}"))
            self.fail_request(runtime, rid, f"refused: {exc}", is_overload=isinstance(exc, CapacityError))
        except Exception as exc:
            # NOTE: a runner's own bug at admission (a tensor on the wrong device, say) fails this request,
            # as a failed batch fails its rows; dropped as a bad message, the request would hang unanswered.
            log.error("stage %s: admission of %s failed:\n%s", runtime.cfg.name, rid, traceback.format_exc(),
                      extra=rate_key(f"stage {runtime.cfg.name}: admission failed: {type(exc).__name__}"))
            self.fail_request(runtime, rid, f"admission failed: {type(exc).__name__}: {exc}", is_overload=False)

    def _abort(self, request_id: str) -> None:
        self.aborted[request_id] = time.monotonic()
        if len(self.aborted) > NUM_ABORTED_KEPT:
            self.aborted.popitem(last=False)
        for runtime in self.stages.values():
            runtime.scheduler.abort(request_id)
            self.outbox.ack(runtime.forget(request_id))

    def fail_request(self, runtime: StageRuntime, request_id: str, message: str, is_overload: bool) -> None:
        """The request fails here: tell the coordinator (which aborts it elsewhere), drop it locally."""
        runtime.scheduler.abort(request_id)
        self.aborted[request_id] = time.monotonic()
        self.outbox.send(ipc.COORDINATOR, Failure(request_id, runtime.cfg.name, message, is_overload))
        self.outbox.ack(runtime.forget(request_id))
