"""Transport contracts of the data plane.

A producer copies a tensor somewhere the consumer can reach and returns a small, msgpack-friendly
reference that travels on the control plane; the consumer turns the reference back into a tensor and,
when done with it, the consumer's engine sends the reference's `slot_id` back so the producer can
reuse the memory. Implementations: shared memory on one host (`shm.ShmSlab` / `shm.ShmReader`) and
torch.distributed point-to-point (`dist.DistSender` / `dist.DistReceiver`). A CUDA IPC transport (same
GPU) plugs in the same way: `put` hands out an IPC handle plus offset, `get` opens it once per segment.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import numpy as np
    import torch


class ProducerTransport(ABC):
    """Producer side: owns the memory, one instance per producer process."""

    @abstractmethod
    def put(self, x: np.ndarray | torch.Tensor, consumer: str) -> Any:
        """Copy `x` out for `consumer`; returns the reference to send on the control plane.

        The memory stays reserved until `ack` receives the reference's `slot_id` or the consumer is
        released.
        """

    @abstractmethod
    def ack(self, slot_ids: Iterable[int]) -> None:
        """The consumer is done with these slots; unknown (already freed) ids are ignored."""

    @abstractmethod
    def release_consumer(self, consumer: str) -> int:
        """Free every slot still held for a consumer that died; returns how many were freed."""

    def is_inline(self, consumer: str) -> bool:
        """Whether tensors for `consumer` must travel inside the control message: no transport of this one reaches
        it (a consumer on another node without a cross-host engine)."""
        return False

    def discard(self, slot_ids: Iterable[int]) -> None:
        """These references were never delivered (the message failed to encode or send): free them."""
        self.ack(slot_ids)

    @abstractmethod
    def close(self) -> None:
        """Free everything, including resources visible to other processes."""


class ConsumerTransport(ABC):
    """Consumer side: resolves references produced by other processes."""

    @abstractmethod
    def get(self, ref: Any, as_torch: bool = False) -> np.ndarray | torch.Tensor:
        """The tensor behind `ref`, valid until its slot is acked (zero-copy where the transport allows)."""

    @abstractmethod
    def forget_owner(self, owner: str) -> None:
        """Drop what is cached for a producer that died or left."""

    @abstractmethod
    def close(self) -> None:
        """Drop every cached resource."""
