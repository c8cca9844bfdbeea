"""First-fit free list over one segment's bytes: the slab's allocator.

Apart from `voice_server/relay/shm.py` because it is offset arithmetic only (no mapping, no locking,
no slots); the slab sizes and aligns requests and calls it under its own lock.
"""

from __future__ import annotations

import bisect


class FreeList:
    """Free regions `(offset, size)` of `[0, capacity)`, sorted by offset; `free` coalesces with both neighbours.

    Not thread-safe: its owner locks around it.
    """

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._regions: list[tuple[int, int]] = [(0, capacity)]

    def alloc(self, size: int) -> int | None:
        """The offset of the first region of at least `size` bytes, cut from its front; None if none fits."""
        for i, (offset, free_size) in enumerate(self._regions):
            if free_size >= size:
                if free_size == size:
                    del self._regions[i]
                else:
                    self._regions[i] = (offset + size, free_size - size)
                return offset
        return None

    def free(self, offset: int, size: int) -> None:
        i = bisect.bisect_left(self._regions, (offset, 0))
        if i < len(self._regions) and offset + size == self._regions[i][0]:  # merge with the next region
            size += self._regions.pop(i)[1]
        if i > 0 and self._regions[i - 1][0] + self._regions[i - 1][1] == offset:  # merge with the previous
            offset, prev_size = self._regions[i - 1]
            self._regions[i - 1] = (offset, prev_size + size)
        else:
            self._regions.insert(i, (offset, size))

    def reset(self) -> None:
        """Everything free again (the slab's owner closed it)."""
        self._regions = [(0, self.capacity)]
