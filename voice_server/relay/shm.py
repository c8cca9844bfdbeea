"""Shared-memory relay on one host: a slab per producer, zero-copy views for consumers.

`ShmSlab` is the producer side (a first-fit free list over one prefaulted segment, overflow segments
when it is full), `ShmReader` the consumer side and `ShmRef` what crosses between them. The segment
files themselves (names, mapping, sweeping what a dead owner left) are `voice_server/relay/shm_segments.py`.
A `SegmentObserver` is told of every segment the slab maps and unmaps (`voice_server/relay/segment_observer.py`).
"""

from __future__ import annotations

import contextlib
import errno
import itertools
import math
import mmap
import os
import threading
import weakref
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from voice_server.relay.base import ConsumerTransport, ProducerTransport
from voice_server.relay.free_list import FreeList
from voice_server.relay.segment_observer import ObservedSegments, SegmentObserver
from voice_server.relay.shm_segments import (
    SHM_DIR,
    check_segment_ids,
    close_mapping,
    map_segment,
    segment_name,
    unlink_owned,
)
from voice_server.relay.tensors import from_buffer, numpy_dtype, to_numpy

if TYPE_CHECKING:
    import torch

ALIGN = 64
_PAGE = mmap.PAGESIZE


class RelayFullError(RuntimeError):
    """A put would exceed the slab's bound on live bytes or overflow segments (retry later)."""


_EXHAUSTION_ERRNOS = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOMEM, errno.ENOSPC})


def is_exhaustion(exc: BaseException) -> bool:
    """A relay error that says a resource ran out (bounds, descriptors, memory, /dev/shm): retryable."""
    return isinstance(exc, RelayFullError) or (isinstance(exc, OSError) and exc.errno in _EXHAUSTION_ERRNOS)


@dataclass(frozen=True)
class ShmRef:
    owner: str
    segment: str
    offset: int
    nbytes: int
    slot_id: int
    dtype: str
    shape: tuple[int, ...]
    # NOTE: overflow segments are mapped per view and never cached: they are unlinked on ack.
    is_overflow: bool = False

    def to_wire(self) -> list[Any]:
        return [self.owner, self.segment, self.offset, self.nbytes, self.slot_id, self.dtype,
                list(self.shape), self.is_overflow]

    @classmethod
    def from_wire(cls, items: list[Any]) -> ShmRef:
        owner, segment, offset, nbytes, slot_id, dtype, shape, is_overflow = items
        return cls(owner, segment, offset, nbytes, slot_id, dtype, tuple(shape), is_overflow)


@dataclass
class _Slot:
    consumer: str
    offset: int
    size: int
    overflow: tuple[str, mmap.mmap] | None = None


class ShmSlab(ProducerTransport):
    """Producer side: first-fit free list (coalescing, 64-byte aligned) over one prefaulted segment.

    `max_bytes` bounds the live bytes (slab and overflow together) and `max_overflow_segments` the
    live overflow segments, each of which holds a file descriptor while mapped; beyond either bound
    `put` raises RelayFullError instead of exhausting /dev/shm or the descriptor table. `observer` (or
    a later `set_observer`) is told of every segment mapped and unmapped.
    """

    def __init__(
        self, launch_id: str, owner: str, capacity_bytes: int, shm_dir: str = SHM_DIR,
        max_bytes: int | None = None, max_overflow_segments: int | None = None,
        observer: SegmentObserver | None = None,
    ) -> None:
        check_segment_ids(launch_id, owner)
        if capacity_bytes <= 0:
            raise ValueError(f"capacity_bytes must be positive, got {capacity_bytes}")
        self.max_bytes = max_bytes
        self.max_overflow_segments = max_overflow_segments
        self.num_overflow_segments = 0
        self.launch_id = launch_id
        self.owner = owner
        self.shm_dir = shm_dir
        self.capacity_bytes = -(-capacity_bytes // ALIGN) * ALIGN
        self._lock = threading.Lock()
        self._live_paths: set[str] = set()
        self._finalizer = weakref.finalize(self, unlink_owned, self._live_paths, os.getpid())
        self._segment_ids = itertools.count()
        self._slot_ids = itertools.count()
        self._slots: dict[int, _Slot] = {}
        self._free = FreeList(self.capacity_bytes)
        self._num_used_bytes = 0
        self.num_overflow_puts = 0
        self._segments = ObservedSegments(observer)
        self.segment, self._mm = self._create_segment(self.capacity_bytes)
        # NOTE: touch every page once so the first puts do not pay page faults.
        np.frombuffer(self._mm, dtype=np.uint8)[::_PAGE] = 0

    @property
    def num_live_slots(self) -> int:
        return len(self._slots)

    @property
    def num_used_bytes(self) -> int:
        """Bytes reserved by live slots (aligned sizes), overflow segments included."""
        return self._num_used_bytes

    def _create_segment(self, size: int) -> tuple[str, mmap.mmap]:
        name = segment_name(self.launch_id, self.owner, next(self._segment_ids))
        path = os.path.join(self.shm_dir, name)
        self._live_paths.add(path)
        try:
            mm = map_segment(path, size)[0]
        except BaseException:
            self._live_paths.discard(path)
            raise
        try:
            self._segments.add(name, mm)
        except BaseException:
            self._drop_segment(name, mm)
            raise
        return name, mm

    def set_observer(self, observer: SegmentObserver | None) -> None:
        """Attach `observer`, told at once of the segments mapped now, or detach with None."""
        self._segments.set_observer(observer)

    def _drop_segment(self, name: str, mm: mmap.mmap) -> None:
        self._segments.remove(name)  # NOTE: before unmapping, so no remote read lands in freed memory.
        close_mapping(mm)
        path = os.path.join(self.shm_dir, name)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
        self._live_paths.discard(path)

    def put(self, x: np.ndarray | torch.Tensor, consumer: str) -> ShmRef:
        if self._mm.closed:
            raise RuntimeError(f"slab {self.segment} is closed")
        name, src = to_numpy(x)
        nbytes = int(src.nbytes)
        size = max(ALIGN, -(-nbytes // ALIGN) * ALIGN)
        with self._lock:
            if self.max_bytes is not None and self._num_used_bytes + size > self.max_bytes:
                raise RelayFullError(
                    f"relay of {self.owner} is full: {self._num_used_bytes} + {size} bytes > {self.max_bytes}"
                )
            offset = self._free.alloc(size)
            if offset is None:
                if self.max_overflow_segments is not None and \
                        self.num_overflow_segments >= self.max_overflow_segments:
                    raise RelayFullError(
                        f"relay of {self.owner} is full: {self.num_overflow_segments} overflow segments live"
                    )
                self.num_overflow_segments += 1
            # NOTE: bytes and segment are reserved under the lock, before the segment exists.
            self._num_used_bytes += size
            slot_id = next(self._slot_ids)
        # NOTE: an overflow segment (fallocate of the whole tensor) is created outside the lock so acks
        # from other threads are not held up.
        try:
            overflow = self._create_segment(size) if offset is None else None
        except BaseException:
            with self._lock:
                self._num_used_bytes -= size
                self.num_overflow_segments -= 1
            raise
        with self._lock:
            self._slots[slot_id] = _Slot(consumer, offset or 0, size, overflow)
            self.num_overflow_puts += overflow is not None
        segment, mm = overflow if overflow is not None else (self.segment, self._mm)
        try:
            dst = np.frombuffer(mm, dtype=src.dtype, count=src.size, offset=offset or 0).reshape(src.shape)
            np.copyto(dst, src, casting="no")  # NOTE: one pass, also for non-contiguous sources.
            del dst
        except BaseException:
            self.ack([slot_id])
            raise
        return ShmRef(self.owner, segment, offset or 0, nbytes, slot_id, name,
                      tuple(int(s) for s in src.shape), overflow is not None)

    def _release(self, slot: _Slot) -> None:
        self._num_used_bytes -= slot.size
        if slot.overflow is not None:
            self.num_overflow_segments -= 1
            self._drop_segment(*slot.overflow)
        else:
            self._free.free(slot.offset, slot.size)

    def ack(self, slot_ids: Iterable[int]) -> None:
        with self._lock:
            for slot_id in slot_ids:
                # NOTE: an ack may arrive after release_consumer already freed the slot: ignore it.
                slot = self._slots.pop(int(slot_id), None)
                if slot is not None:
                    self._release(slot)

    def release_consumer(self, consumer: str) -> int:
        with self._lock:
            slot_ids = [sid for sid, slot in self._slots.items() if slot.consumer == consumer]
            for slot_id in slot_ids:
                self._release(self._slots.pop(slot_id))
        return len(slot_ids)

    def close(self) -> None:
        with self._lock:
            for slot in self._slots.values():
                if slot.overflow is not None:
                    self._drop_segment(*slot.overflow)
            self._slots.clear()
            self._free.reset()
            self._num_used_bytes = 0
            self.num_overflow_segments = 0
            if not self._mm.closed:
                self._drop_segment(self.segment, self._mm)
            self._finalizer()

    def __enter__(self) -> ShmSlab:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class ShmReader(ConsumerTransport):
    """Consumer side: maps each producer's slab once; overflow segments are mapped per view."""

    def __init__(self, shm_dir: str = SHM_DIR) -> None:
        self.shm_dir = shm_dir
        self._maps: dict[str, tuple[str, mmap.mmap, int]] = {}  # segment -> (owner, mapping, inode)

    @property
    def mapped_segments(self) -> list[str]:
        return sorted(self._maps)

    def _mapping(self, ref: ShmRef) -> mmap.mmap:
        path = os.path.join(self.shm_dir, ref.segment)
        if ref.is_overflow:
            return map_segment(path)[0]
        entry = self._maps.get(ref.segment)
        # NOTE: a restarted producer recreates its slab under the same name; one stat tells them apart.
        if entry is not None and os.stat(path).st_ino != entry[2]:
            close_mapping(self._maps.pop(ref.segment)[1])
            entry = None
        if entry is None:
            mm, inode = map_segment(path)
            entry = self._maps[ref.segment] = (ref.owner, mm, inode)
        return entry[1]

    def view(self, ref: ShmRef, as_torch: bool = False) -> np.ndarray | torch.Tensor:
        """Zero-copy, writable array over the slot: valid until the slot is acked."""
        expected = math.prod(ref.shape) * numpy_dtype(ref.dtype).itemsize
        if ref.nbytes != expected:
            raise ValueError(f"ShmRef nbytes={ref.nbytes} does not match {ref.dtype}{list(ref.shape)}")
        mm = self._mapping(ref)
        if ref.offset < 0 or ref.offset + ref.nbytes > len(mm):
            raise ValueError(f"ShmRef [{ref.offset}, +{ref.nbytes}) is outside {ref.segment} ({len(mm)} B)")
        # NOTE: the view keeps its mapping alive; an overflow mapping is unmapped with its last view.
        buf = memoryview(mm)[ref.offset:ref.offset + ref.nbytes]
        return from_buffer(buf, ref.dtype, ref.shape, as_torch)

    def get(self, ref: Any, as_torch: bool = False) -> np.ndarray | torch.Tensor:
        return self.view(ref, as_torch)

    def forget_owner(self, owner: str) -> None:
        for segment in [s for s, (o, _, _) in self._maps.items() if o == owner]:
            close_mapping(self._maps.pop(segment)[1])

    def close(self) -> None:
        for _, mm, _ in self._maps.values():
            close_mapping(mm)
        self._maps.clear()
