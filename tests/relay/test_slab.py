"""ShmSlab allocator and ShmReader behaviour within one process (real /dev/shm segments)."""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator

import numpy as np
import pytest

from voice_server.relay import ShmReader, ShmSlab, sweep
from voice_server.relay.shm import ALIGN
from voice_server.relay.shm_segments import SHM_DIR, list_segments


@pytest.fixture()
def launch_id() -> Iterator[str]:
    lid = uuid.uuid4().hex[:12]
    yield lid
    assert sweep(lid) == []


def test_first_fit_aligned_and_coalescing(launch_id: str) -> None:
    with ShmSlab(launch_id, "p", 1024) as slab:
        refs = [slab.put(np.zeros(n, np.uint8), "c") for n in (1, 100, 64, 200)]
        assert [r.offset for r in refs] == [0, 64, 192, 256]  # sizes 64, 128, 64, 256
        assert all(r.offset % ALIGN == 0 for r in refs)
        assert slab.num_used_bytes == 512 and slab.num_live_slots == 4
        slab.ack([refs[1].slot_id])
        assert slab.put(np.zeros(65, np.uint8), "c").offset == 64  # first fit reuses the hole
        slab.ack([refs[0].slot_id, refs[2].slot_id])  # holes [0,64) and [192,256)
        big = slab.put(np.zeros(64 + 1, np.uint8), "c")
        assert big.offset == 512  # no hole of 128 bytes yet
        slab.ack([big.slot_id, refs[3].slot_id])
        slab.ack([refs[3].slot_id, 12345])  # double and unknown acks are ignored
        live = slab.num_live_slots
        assert live == 1
        hole = slab.put(np.zeros(128, np.uint8), "c")
        assert hole.offset == 192  # [192,256) merged with the freed [256,512) region
        slab.release_consumer("c")
        assert slab.num_used_bytes == 0
        whole = slab.put(np.zeros(1024, np.uint8), "c")
        assert whole.offset == 0 and not whole.is_overflow  # everything coalesced back into one region


def test_overflow_when_full_and_for_oversized(launch_id: str) -> None:
    with ShmSlab(launch_id, "p", 256) as slab:
        inside = slab.put(np.arange(64, dtype=np.float32), "c")
        over = slab.put(np.arange(8, dtype=np.int64), "c")
        huge = slab.put(np.arange(1000, dtype=np.int16), "c")
        assert not inside.is_overflow and over.is_overflow and huge.is_overflow
        assert len(list_segments(launch_id, "p")) == 3
        reader = ShmReader()
        assert np.array_equal(reader.view(huge), np.arange(1000, dtype=np.int16))
        slab.ack([over.slot_id, huge.slot_id])
        assert list_segments(launch_id, "p") == [slab.segment]
        assert slab.num_used_bytes == 256
        reader.close()
    assert list_segments(launch_id) == []


def test_views_are_zero_copy_and_close_unlinks(launch_id: str) -> None:
    slab = ShmSlab(launch_id, "p", 1 << 16)
    reader = ShmReader()
    ref = slab.put(np.arange(100, dtype=np.float32), "c")
    a, b = reader.view(ref), reader.view(ref)
    assert isinstance(a, np.ndarray) and np.shares_memory(a, b)
    a[0] = 42.0
    assert b[0] == 42.0
    assert reader.mapped_segments == [slab.segment]
    slab.close()
    slab.close()  # idempotent
    assert not os.path.exists(os.path.join(SHM_DIR, ref.segment))
    assert b[1] == 1.0  # NOTE: the consumer's mapping survives the unlink until it lets go
    reader.forget_owner("p")
    assert reader.mapped_segments == []
    with pytest.raises(RuntimeError, match="closed"):
        slab.put(np.zeros(1), "c")


def test_reader_notices_a_restarted_producer(launch_id: str) -> None:
    reader = ShmReader()
    with ShmSlab(launch_id, "p", 4096) as first:
        old = reader.view(first.put(np.full(4, 1.0, np.float32), "c"))
    with ShmSlab(launch_id, "p", 4096) as second:  # same owner, same segment name, new file
        ref = second.put(np.full(4, 2.0, np.float32), "c")
        assert ref.segment == first.segment
        assert np.array_equal(reader.view(ref), np.full(4, 2.0, np.float32))
    assert np.array_equal(old, np.full(4, 1.0, np.float32))  # old views keep the old mapping
    reader.close()


def test_garbage_collected_slab_unlinks(launch_id: str) -> None:
    slab = ShmSlab(launch_id, "p", 4096)
    slab.put(np.zeros(8192, np.uint8), "c")  # overflow segment too
    assert len(list_segments(launch_id)) == 2
    del slab
    assert list_segments(launch_id) == []


def test_invalid_arguments(launch_id: str) -> None:
    with pytest.raises(ValueError, match="launch_id"):
        ShmSlab("a-b", "p", 1024)
    with pytest.raises(ValueError, match="owner"):
        ShmSlab(launch_id, "a/b", 1024)
    with pytest.raises(ValueError, match="capacity_bytes"):
        ShmSlab(launch_id, "p", 0)
    with ShmSlab(launch_id, "p", 1024) as slab:
        ref = slab.put(np.zeros(4, np.float32), "c")
        reader = ShmReader()
        with pytest.raises(ValueError, match="nbytes"):
            reader.view(type(ref)(ref.owner, ref.segment, ref.offset, 8, ref.slot_id, "float32", (4,)))
        with pytest.raises(ValueError, match="outside"):
            reader.view(type(ref)(ref.owner, ref.segment, 1024, 16, ref.slot_id, "float32", (4,)))
        reader.close()
