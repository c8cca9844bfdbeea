"""torch.distributed point-to-point transport (gloo on CPU; the same calls serve NCCL across hosts).

The producer starts an asynchronous `isend` of the tensor's bytes and returns a `DistRef` for the control
plane; the consumer posts the matching `recv` (same tag) into a fresh buffer. The producer keeps the
source bytes alive until the consumer acks the ref's `slot_id` (its tag), which also reaps the send.
The caller initialises the process group (`init_process_group`, e.g. `tcp://host:port`) beforehand.

NOTE: not used by the engine yet: no config field selects it, nothing initialises a process group, and no
stage or the coordinator creates a sender or receiver (the shared-memory relay, `voice_server/relay/shm.py`,
is the only data plane). Only the codec knows its `DistRef`. It is kept, with its test
(`tests/relay/test_dist.py`, gloo on 127.0.0.1), for the multi-host relay work (issue #23); what it has and
has not been run under is in docs/ARCHITECTURE.md, "Data plane: the relay".
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from voice_server.relay.base import ConsumerTransport, ProducerTransport
from voice_server.relay.tensors import from_buffer, numpy_dtype, to_numpy

if TYPE_CHECKING:
    import torch

# NOTE: gloo tags are C ints; wrapping is safe as long as fewer than 2**31 sends are in flight.
_MAX_TAG = 2**31 - 1


@dataclass(frozen=True)
class DistRef:
    src_rank: int
    tag: int
    dtype: str
    shape: tuple[int, ...]
    nbytes: int

    @property
    def slot_id(self) -> int:
        return self.tag

    def to_wire(self) -> list[Any]:
        return [self.src_rank, self.tag, self.dtype, list(self.shape), self.nbytes]

    @classmethod
    def from_wire(cls, items: list[Any]) -> DistRef:
        src_rank, tag, dtype, shape, nbytes = items
        return cls(src_rank, tag, dtype, tuple(shape), nbytes)


def _flat_bytes(x: np.ndarray | torch.Tensor) -> tuple[str, tuple[int, ...], torch.Tensor]:
    import torch

    name, arr = to_numpy(x)
    flat = np.ascontiguousarray(arr).reshape(-1).view(np.uint8)
    if not flat.flags.writeable:
        flat = flat.copy()  # NOTE: torch.from_numpy needs writable memory.
    return name, tuple(int(s) for s in arr.shape), torch.from_numpy(flat)


class DistSender(ProducerTransport):
    """Producer side; `consumer_ranks` maps consumer names to ranks for `put`."""

    def __init__(self, consumer_ranks: Mapping[str, int] | None = None) -> None:
        import torch.distributed as dist

        if not dist.is_initialized():
            raise RuntimeError("torch.distributed must be initialised before creating a DistSender")
        self.rank = dist.get_rank()
        self.consumer_ranks = dict(consumer_ranks or {})
        self._tags = itertools.count()
        self._pending: dict[int, tuple[str, Any, torch.Tensor]] = {}  # tag -> (consumer, work, bytes)

    @property
    def num_live_slots(self) -> int:
        return len(self._pending)

    def send(self, x: np.ndarray | torch.Tensor, dst_rank: int, consumer: str = "") -> DistRef:
        import torch.distributed as dist

        dtype, shape, flat = _flat_bytes(x)
        tag = next(self._tags) % _MAX_TAG
        # NOTE: empty tensors carry no bytes; the receiver rebuilds them from the ref alone.
        work = dist.isend(flat, dst=dst_rank, tag=tag) if flat.numel() else None
        self._pending[tag] = (consumer or str(dst_rank), work, flat)
        return DistRef(self.rank, tag, dtype, shape, int(flat.numel()))

    def put(self, x: np.ndarray | torch.Tensor, consumer: str) -> DistRef:
        try:
            dst_rank = self.consumer_ranks[consumer]
        except KeyError:
            raise KeyError(f"no rank known for consumer {consumer!r} (consumer_ranks)") from None
        return self.send(x, dst_rank, consumer)

    def ack(self, slot_ids: Iterable[int]) -> None:
        for tag in slot_ids:
            entry = self._pending.pop(int(tag), None)
            if entry is not None and entry[1] is not None:
                entry[1].wait()  # NOTE: already complete once the consumer received it.

    def discard(self, slot_ids: Iterable[int]) -> None:
        # NOTE: never delivered, so nobody will post the matching recv: do not wait for the send.
        for tag in slot_ids:
            self._pending.pop(int(tag), None)

    def release_consumer(self, consumer: str) -> int:
        # NOTE: a send to a dead peer cannot be cancelled; dropping it lets gloo fail it on teardown.
        tags = [tag for tag, (c, _, _) in self._pending.items() if c == consumer]
        for tag in tags:
            del self._pending[tag]
        return len(tags)

    def close(self) -> None:
        self._pending.clear()


class DistReceiver(ConsumerTransport):
    """Consumer side: each `recv` fills a fresh buffer owned by the caller (no ack needed to keep it)."""

    def recv(self, ref: DistRef, src_rank: int | None = None, as_torch: bool = False) -> np.ndarray | torch.Tensor:
        import torch
        import torch.distributed as dist

        expected = math.prod(ref.shape) * numpy_dtype(ref.dtype).itemsize
        if ref.nbytes != expected:
            raise ValueError(f"DistRef nbytes={ref.nbytes} does not match {ref.dtype}{list(ref.shape)}")
        buf = torch.empty(ref.nbytes, dtype=torch.uint8)
        if ref.nbytes:
            dist.recv(buf, src=ref.src_rank if src_rank is None else src_rank, tag=ref.tag)
        return from_buffer(buf.numpy(), ref.dtype, ref.shape, as_torch)

    def get(self, ref: Any, as_torch: bool = False) -> np.ndarray | torch.Tensor:
        return self.recv(ref, as_torch=as_torch)

    def forget_owner(self, owner: str) -> None:
        pass  # NOTE: nothing is cached per producer.

    def close(self) -> None:
        pass
