"""`Outbox`: a process's control messages to other processes, and its acks of relay slots. One for the
coordinator and one per stage process, so both send and ack the same way.

Messages for one destination go out together, as one ZMQ multipart message (one control message per frame)
per `flush`: a stage holds its sends for a loop turn (a step's outputs for every request in its batch, its
acks, its failures), the coordinator queues the streamed input of every session in one turn of its event
loop. Receivers take every frame in order, so the order per destination is the order sent.
"""

from __future__ import annotations

from voice_server.engine import ipc
from voice_server.engine.messages import Codec, Message, SlabRef, acks_for
from voice_server.relay.shm import ShmSlab


class Outbox:
    def __init__(self, peers: ipc.Peers, codec: Codec, slab: ShmSlab, owner: str) -> None:
        self.peers, self.codec, self.slab, self.owner = peers, codec, slab, owner
        self.is_holding = False
        """While True, `send` and `post` only queue; `flush` sends what is queued."""
        self._queued: dict[str, list[bytes]] = {}
        self.counters = {"num_messages_out": 0, "num_frames_out": 0}
        """ZMQ messages sent, and the control messages (frames) they carried."""

    @property
    def is_empty(self) -> bool:
        return not self._queued

    def encode(self, process: str, msg: Message, taken: list[int] | None = None) -> bytes:
        """`msg` for `process`, its relay slots appended to `taken` (for a caller that may drop it unsent)."""
        return self.codec.encode(msg, consumer=process, taken=taken)

    def queue(self, process: str, data: bytes) -> None:
        """Queue an encoded message until the next `flush`, whatever `is_holding` says."""
        self._queued.setdefault(process, []).append(data)

    def post(self, process: str, data: bytes) -> None:
        """Send an encoded message (at the next `flush` while holding)."""
        self.queue(process, data)
        if not self.is_holding:
            self.flush()

    def send(self, process: str, msg: Message) -> None:
        self.post(process, self.encode(process, msg))

    def flush(self) -> None:
        queued, self._queued = self._queued, {}
        for process, frames in queued.items():
            self.peers.get(process).send_multipart(frames)
            self.counters["num_messages_out"] += 1
            self.counters["num_frames_out"] += len(frames)

    def ack(self, refs: list[SlabRef]) -> None:
        """This process is done with these relay slots: its own are freed at once, others' owners told."""
        for ack in acks_for(refs):
            if ack.owner == self.owner:
                self.slab.ack(ack.slot_ids)
            else:
                self.send(ipc.owner_process(ack.owner), ack)
