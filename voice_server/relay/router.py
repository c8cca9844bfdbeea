"""One relay per process whatever node its peers run on: shared memory to local consumers, Mooncake to remote ones.

`RelayRouter` (producer side) puts every tensor in the process's `ShmSlab`; for a consumer on another node
it also exports the slot (`mooncake.MooncakeExporter`) and returns a `RemoteRef` instead of the `ShmRef`.
Either way the slot lives in the slab until the consumer acks it, so bounds, acks and `release_consumer`
are the slab's. `RelayReaders` (consumer side) resolves each reference with the transport it names.
"""

from __future__ import annotations

import errno
import threading
from collections.abc import Callable, Collection, Iterable
from typing import TYPE_CHECKING, Any

from voice_server.relay.base import ConsumerTransport, ProducerTransport
from voice_server.relay.mooncake import MooncakeExporter, RemoteRef
from voice_server.relay.shm import ShmRef, ShmSlab

if TYPE_CHECKING:
    import numpy as np
    import torch


class RelayRouter(ProducerTransport):
    """`put` for a consumer that `is_remote` says is on another node goes through an exporter over the slab.

    `is_remote` is a predicate on consumer (process) names, or a collection of the remote ones. The
    exporter is created by `exporter_factory` on the first remote put, and then serves the whole slab
    (see `voice_server/relay/mooncake.py` for what that exposes on the network).
    """

    def __init__(
        self, slab: ShmSlab, is_remote: Callable[[str], bool] | Collection[str] = (),
        exporter_factory: Callable[[], MooncakeExporter] | None = None,
    ) -> None:
        self.slab = slab
        self.is_remote: Callable[[str], bool] = is_remote if callable(is_remote) else frozenset(is_remote).__contains__
        self.exporter_factory = exporter_factory
        self.exporter: MooncakeExporter | None = None
        self._exporter_lock = threading.Lock()
        self.num_local_puts = 0
        self.num_remote_puts = 0
        self.num_remote_bytes = 0

    @property
    def owner(self) -> str:
        return self.slab.owner

    def _exporter(self) -> MooncakeExporter:
        with self._exporter_lock:
            if self.exporter is None:
                if self.exporter_factory is None:
                    raise RuntimeError(f"relay of {self.owner} has a remote consumer but no cross-host exporter")
                exporter = self.exporter_factory()
                try:
                    exporter.observe(self.slab)
                except BaseException:
                    exporter.close()
                    raise
                self.exporter = exporter
            return self.exporter

    def is_inline(self, consumer: str) -> bool:
        # NOTE: without a cross-host engine (Mooncake not installed) the control message carries the bytes.
        return self.exporter_factory is None and self.is_remote(consumer)

    def put(self, x: np.ndarray | torch.Tensor, consumer: str) -> ShmRef | RemoteRef:
        if not self.is_remote(consumer):
            self.num_local_puts += 1
            return self.slab.put(x, consumer)
        exporter = self._exporter()  # NOTE: before the put, so a failing engine start reserves nothing.
        ref = self.slab.put(x, consumer)
        try:
            remote = exporter.export(ref)
        except BaseException:
            self.slab.ack([ref.slot_id])
            raise
        self.num_remote_puts += 1
        self.num_remote_bytes += ref.nbytes
        return remote

    def ack(self, slot_ids: Iterable[int]) -> None:
        self.slab.ack(slot_ids)

    def discard(self, slot_ids: Iterable[int]) -> None:
        self.slab.discard(slot_ids)

    def release_consumer(self, consumer: str) -> int:
        return self.slab.release_consumer(consumer)

    def close(self) -> None:
        """Stop serving the slab to other nodes, then free it (closing an exporter may stall ~1 s)."""
        with self._exporter_lock:
            exporter, self.exporter = self.exporter, None
        if exporter is not None:
            exporter.close()
        self.slab.close()


class RelayReaders(ConsumerTransport):
    """Dispatches `get` by reference type: `ShmRef` to `shm_reader`, `RemoteRef` to a cross-host reader made
    by `remote_factory` on first use (None: this process cannot read remote refs, each raises OSError)."""

    def __init__(self, shm_reader: ConsumerTransport,
                 remote_factory: Callable[[], ConsumerTransport] | None = None) -> None:
        self.shm_reader = shm_reader
        self.remote_factory = remote_factory
        self.remote_reader: ConsumerTransport | None = None
        self._remote_lock = threading.Lock()

    def _remote(self) -> ConsumerTransport:
        with self._remote_lock:
            if self.remote_reader is None:
                if self.remote_factory is None:
                    raise OSError(errno.EPROTONOSUPPORT, "this process has no cross-host reader for a RemoteRef")
                try:
                    self.remote_reader = self.remote_factory()
                except (RuntimeError, OSError) as exc:
                    # NOTE: as OSError the codec fails only the message at hand (RelayReadError).
                    raise OSError(errno.EPROTONOSUPPORT, f"cannot start the cross-host reader: {exc}") from exc
            return self.remote_reader

    def get(self, ref: Any, as_torch: bool = False) -> np.ndarray | torch.Tensor:
        if isinstance(ref, RemoteRef):
            return self._remote().get(ref, as_torch)
        if isinstance(ref, ShmRef):
            return self.shm_reader.get(ref, as_torch)
        raise ValueError(f"no reader for {type(ref).__name__}")

    def forget_owner(self, owner: str) -> None:
        self.shm_reader.forget_owner(owner)
        if self.remote_reader is not None:
            self.remote_reader.forget_owner(owner)

    def close(self) -> None:
        with self._remote_lock:
            remote, self.remote_reader = self.remote_reader, None
        if remote is not None:
            remote.close()
        self.shm_reader.close()
