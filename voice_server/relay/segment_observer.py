"""Telling an observer of each shared-memory segment a slab maps and unmaps.

The cross-host exporter (`voice_server/relay/mooncake.py`) is one: it registers every segment of the
producer's slab with its transfer engine, so a consumer on another node can read slots in place.
"""

from __future__ import annotations

import mmap
import threading
from typing import Protocol

import numpy as np


class SegmentObserver(Protocol):
    """Told of each segment a slab maps (after mapping it) and unmaps (before unmapping it)."""

    def on_map(self, name: str, address: int, size: int) -> None:
        """May raise: the segment is then dropped and the put (or `set_observer`) fails."""

    def on_unmap(self, name: str, address: int) -> None:
        """Must not raise: it runs while acks free slots."""


def buffer_address(mm: mmap.mmap) -> int:
    """The virtual address of a mapping's first byte."""
    # NOTE: the temporary view is dropped before returning, so no exported buffer blocks mm.close().
    view = np.frombuffer(mm, dtype=np.uint8)
    try:
        return int(view.ctypes.data)
    finally:
        del view


class ObservedSegments:
    """A slab's mapped segments (name -> address, size) and the observer told of them.

    NOTE: its own lock, taken inside the slab's when acks unmap: overflow segments are mapped outside the
    slab's lock, and an observer attached meanwhile must be told of each segment exactly once.
    """

    def __init__(self, observer: SegmentObserver | None = None) -> None:
        self._lock = threading.Lock()
        self._observer = observer
        self._mapped: dict[str, tuple[int, int]] = {}

    def add(self, name: str, mm: mmap.mmap) -> None:
        """Raises what the observer's on_map raises; the segment is then not recorded."""
        with self._lock:
            address, size = buffer_address(mm), len(mm)
            if self._observer is not None:
                self._observer.on_map(name, address, size)
            self._mapped[name] = (address, size)

    def remove(self, name: str) -> None:
        with self._lock:
            entry = self._mapped.pop(name, None)
            if entry is not None and self._observer is not None:
                self._observer.on_unmap(name, entry[0])

    def set_observer(self, observer: SegmentObserver | None) -> None:
        """Attach `observer` (told of the segments mapped now) or detach with None (the previous one is
        told each is gone). If the new one's on_map raises, it is told of the undone ones and not attached."""
        with self._lock:
            old, self._observer = self._observer, None
            if old is not None:
                for name, (address, _) in self._mapped.items():
                    old.on_unmap(name, address)
            if observer is None:
                return
            told: list[tuple[str, int]] = []
            try:
                for name, (address, size) in self._mapped.items():
                    observer.on_map(name, address, size)
                    told.append((name, address))
            except BaseException:
                for name, address in told:
                    observer.on_unmap(name, address)
                raise
            self._observer = observer
