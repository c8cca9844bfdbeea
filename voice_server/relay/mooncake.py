"""Cross-host relay on Mooncake Transfer Engine: the consumer pulls a slot out of the producer's slab.

The producer keeps its shared-memory slab (`shm.ShmSlab`): `MooncakeExporter` registers every segment of
it with a transfer engine and turns a slot's `ShmRef` into a `RemoteRef` (the engine's session plus the
slot's virtual address). `MooncakeReader`, on the consumer's node, reads those bytes with one transfer
into memory of its own and returns a tensor the caller owns; the consumer's engine then acks the ref's
`slot_id` to its owner exactly as for an `ShmRef`, so the slab's bounds, acks and overload handling are
unchanged. No metadata server: the engines find each other by P2P handshake.

SECURITY: a Mooncake engine serves its registered memory, and the list of its registered buffers, to
anyone who can reach its ports, unauthenticated. Its two listening sockets (handshake RPC and TCP data, in
15000-17000 unless MC_MIN_RPC_PORT / MC_MAX_RPC_PORT say otherwise) bind every interface whatever `host`
is given (`host` is only what it advertises): the exporter exposes the producer's whole slab. Use it only
on a trusted cluster network, with those ports firewalled from anything else.

Mooncake (`pip install mooncake-transfer-engine-non-cuda`, or `mooncake-transfer-engine` with CUDA) is
imported only when an engine is created, so `import voice_server.relay` never needs it.
"""

from __future__ import annotations

import errno
import math
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from voice_server.relay.base import ConsumerTransport
from voice_server.relay.mooncake_engine import Engine, transfer_timeout_s
from voice_server.relay.shm import ShmRef
from voice_server.relay.tensors import from_buffer, numpy_dtype

if TYPE_CHECKING:
    import torch

    from voice_server.relay.shm import ShmSlab

DEFAULT_STAGING_BYTES = 8 << 20
_MAX_ADDRESS = 2**64 - 1


@dataclass(frozen=True)
class RemoteRef:
    """A slot of a producer's slab (its `ShmRef`), readable at `address` through the Mooncake engine at `session`."""

    slot: ShmRef
    session: str  # "host:port" of the producer's engine
    address: int  # the producer's virtual address of the slot's first byte

    @property
    def owner(self) -> str:
        return self.slot.owner

    @property
    def slot_id(self) -> int:
        return self.slot.slot_id

    @property
    def nbytes(self) -> int:
        return self.slot.nbytes

    @property
    def dtype(self) -> str:
        return self.slot.dtype

    @property
    def shape(self) -> tuple[int, ...]:
        return self.slot.shape

    def to_wire(self) -> list[Any]:
        return [self.slot.to_wire(), self.session, self.address]

    @classmethod
    def from_wire(cls, items: list[Any]) -> RemoteRef:
        slot, session, address = items
        return cls(ShmRef.from_wire(slot), session, address)


class MooncakeExporter:
    """Producer side: an engine on `host` that serves the segments of the slab it observes.

    A `SegmentObserver` of the slab (`observe`): each segment is registered when the slab maps it and
    unregistered before the slab unmaps it, so a stale read fails instead of reading freed memory.
    See the module docstring: the engine serves the whole slab unauthenticated on the network.
    """

    def __init__(self, host: str, slab: ShmSlab | None = None, protocol: str = "tcp", device_name: str = "") -> None:
        self._engine = Engine(host, protocol, device_name)
        self.session = self._engine.session
        self._lock = threading.Lock()
        self._segments: dict[str, int] = {}  # registered segment -> its address
        self._slab: ShmSlab | None = None
        self.num_exports = 0
        self.num_export_bytes = 0
        if slab is not None:
            self.observe(slab)

    @property
    def registered_segments(self) -> list[str]:
        return sorted(self._segments)

    def observe(self, slab: ShmSlab) -> None:
        """Register the slab's mapped segments now and its later ones as they come."""
        if self._slab is not None:
            raise RuntimeError(f"exporter {self.session} already observes a slab")
        slab.set_observer(self)
        self._slab = slab

    def on_map(self, name: str, address: int, size: int) -> None:
        with self._lock:
            self._engine.register(address, size)
            self._segments[name] = address

    def on_unmap(self, name: str, address: int) -> None:
        with self._lock:
            if self._segments.pop(name, None) is not None:
                self._engine.unregister(address)

    def export(self, ref: ShmRef) -> RemoteRef:
        """The remote reference to a slot of the observed slab (its bytes stay where they are)."""
        base = self._segments.get(ref.segment)
        if base is None:
            raise RuntimeError(f"segment {ref.segment} is not registered with exporter {self.session}")
        self.num_exports += 1
        self.num_export_bytes += ref.nbytes
        return RemoteRef(ref, self.session, base + ref.offset)

    def close(self) -> None:
        """Unregister every segment (the slab keeps them) and stop the engine."""
        if self._slab is not None:
            self._slab.set_observer(None)
            self._slab = None
        with self._lock:
            for address in self._segments.values():
                self._engine.unregister(address)
            self._segments.clear()
            self._engine.close()


class MooncakeReader(ConsumerTransport):
    """Consumer side: an engine on `host` that reads remote slots into memory the caller owns.

    Reads up to `staging_bytes` land in one registered staging buffer (allocated on first use) and are
    copied out; larger ones land straight in the returned array, registered for that read only (measured
    at 64 MiB over loopback TCP: as fast as or faster than reading through the staging buffer in pieces,
    one copy fewer; with RDMA a registration pins pages, so the staging buffer keeps the frequent small
    reads free of it). Reads from 1 MiB up are polled with short sleeps (`mooncake_engine.POLL_BYTES`).

    A read that fails (producer gone, slot already freed, peer unreachable) raises OSError, which the codec
    reports as RelayReadError for that one message. `get` blocks for the transfer; a hung producer holds it
    for MC_TRANSFER_TIMEOUT (30 s by default, at least 5) before it fails with ETIMEDOUT; the engine may
    still write into that read's buffer, so the buffer is never reused, and for as long again every read
    from that producer fails at once rather than wait its own timeout.
    Like the exporter's, this engine listens on every interface, unauthenticated (module docstring).
    """

    def __init__(self, host: str, staging_bytes: int = DEFAULT_STAGING_BYTES, protocol: str = "tcp",
                 device_name: str = "") -> None:
        if staging_bytes <= 0:
            raise ValueError(f"staging_bytes must be positive, got {staging_bytes}")
        self._engine = Engine(host, protocol, device_name)
        self.session = self._engine.session
        self.staging_bytes = staging_bytes
        self._staging: np.ndarray | None = None
        self._staging_lock = threading.Lock()
        self._abandoned: list[np.ndarray] = []  # NOTE: buffers a timed-out read may still write into.
        self._timed_out: dict[str, float] = {}  # session -> when a read from it timed out
        self.num_reads = 0
        self.num_read_bytes = 0

    def _transfer(self, ref: RemoteRef, address: int) -> None:
        since = time.monotonic() - self._timed_out.get(ref.session, -math.inf)
        if since < transfer_timeout_s():
            raise OSError(errno.EIO, f"Mooncake peer {ref.session} timed out {since:.1f} s ago: not reading "
                                     f"{ref.owner} slot {ref.slot_id}")
        try:
            self._engine.read(ref.session, address, ref.address, ref.nbytes)
        except OSError as exc:
            if exc.errno == errno.ETIMEDOUT:
                self._timed_out[ref.session] = time.monotonic()
            raise OSError(exc.errno, f"{exc.strerror}: {ref.owner} slot {ref.slot_id} (producer gone or slot "
                                     "freed)") from None

    def _read_staged(self, ref: RemoteRef) -> np.ndarray:
        with self._staging_lock:
            if self._staging is None:
                staging = np.empty(self.staging_bytes, dtype=np.uint8)
                self._engine.register(int(staging.ctypes.data), staging.nbytes)
                self._staging = staging
            try:
                self._transfer(ref, int(self._staging.ctypes.data))
            except OSError as exc:
                if exc.errno == errno.ETIMEDOUT:
                    self._abandoned.append(self._staging)
                    self._staging = None
                raise
            return self._staging[:ref.nbytes].copy()

    def _read_direct(self, ref: RemoteRef) -> np.ndarray:
        out = np.empty(ref.nbytes, dtype=np.uint8)
        address = int(out.ctypes.data)
        self._engine.register(address, ref.nbytes)
        try:
            self._transfer(ref, address)
        except OSError as exc:
            if exc.errno == errno.ETIMEDOUT:
                self._abandoned.append(out)  # NOTE: stays registered, so its address is never reused either.
            else:
                self._engine.unregister(address)
            raise
        # NOTE: always, or a later array at the same address could not be registered (overlap).
        self._engine.unregister(address)
        return out

    def get(self, ref: Any, as_torch: bool = False) -> np.ndarray | torch.Tensor:
        """A fresh copy of the slot: the caller owns it, it stays valid after the ack."""
        if not isinstance(ref, RemoteRef):
            raise ValueError(f"MooncakeReader reads RemoteRef, not {type(ref).__name__}")
        expected = math.prod(ref.shape) * numpy_dtype(ref.dtype).itemsize
        if ref.nbytes != expected:
            raise ValueError(f"RemoteRef nbytes={ref.nbytes} does not match {ref.dtype}{list(ref.shape)}")
        if not 0 <= ref.address <= _MAX_ADDRESS - ref.nbytes:
            raise ValueError(f"RemoteRef address {ref.address:#x} (+{ref.nbytes} B) is not a valid address")
        if ref.nbytes == 0:
            data = np.empty(0, dtype=np.uint8)  # NOTE: nothing to read (and Mooncake rejects empty transfers).
        elif ref.nbytes <= self.staging_bytes:
            data = self._read_staged(ref)
        else:
            data = self._read_direct(ref)
        self.num_reads += 1
        self.num_read_bytes += ref.nbytes
        return from_buffer(data, ref.dtype, ref.shape, as_torch)

    def forget_owner(self, owner: str) -> None:
        pass  # NOTE: the engine caches one handle per session (no API drops it); a restarted producer has a new port.

    def close(self) -> None:
        """Stop the engine (may stall the process up to ~1 s, see `mooncake_engine.Engine.close`)."""
        with self._staging_lock:
            if self._staging is not None:
                self._engine.unregister(int(self._staging.ctypes.data))
            self._staging = None
            self._engine.close()
