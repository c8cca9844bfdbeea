"""Relay across real spawned processes and real /dev/shm segments."""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import sys
import uuid
from collections.abc import Iterator
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from voice_server.relay import ShmSlab, pack, sweep, unpack
from voice_server.relay.shm_segments import SHM_DIR, list_segments

sys.path.insert(0, str(Path(__file__).parent))
import relay_workers

CTX = mp.get_context("spawn")


@pytest.fixture()
def launch_id() -> Iterator[str]:
    lid = uuid.uuid4().hex[:12]
    yield lid
    leftovers = sweep(lid)
    assert leftovers == [], f"segments left behind: {leftovers}"


@pytest.fixture(scope="module")
def echo() -> Iterator[Connection]:
    parent, child = CTX.Pipe()
    proc = CTX.Process(target=relay_workers.echo_consumer, args=(child,), daemon=True)
    proc.start()
    yield parent
    parent.send_bytes(b"")
    proc.join(timeout=10)
    assert proc.exitcode == 0


def _numpy_cases() -> dict[str, Any]:
    rng = np.random.default_rng(0)
    base = rng.standard_normal((6, 5, 8, 7)).astype(np.float32)
    return {
        "f32_4d_noncontig": base.transpose(2, 0, 3, 1)[:, ::2],
        "f32_0d": np.array(3.25, np.float32),
        "f32_empty": np.zeros((0, 4), np.float32),
        "f16_1d": rng.standard_normal(3000).astype(np.float16),
        "i64_1d": rng.integers(-(2**62), 2**62, 5000, dtype=np.int64),
        "u8_2d": rng.integers(0, 256, (64, 300), dtype=np.uint8),
        "bool_1d": rng.random(7000) > 0.5,
        "nested": [np.arange(2000, dtype=np.int64), {"x": base[:, 0]}],
    }


def _assert_bitwise(a: Any, b: Any) -> None:
    if isinstance(a, np.ndarray):
        assert isinstance(b, np.ndarray) and a.dtype == b.dtype and a.shape == b.shape
        assert a.tobytes() == b.tobytes()
    elif isinstance(a, dict):
        assert a.keys() == b.keys()
        for k in a:
            _assert_bitwise(a[k], b[k])
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b)
        for x, y in zip(a, b, strict=True):
            _assert_bitwise(x, y)
    else:
        import torch

        assert isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)
        assert a.dtype == b.dtype and a.shape == b.shape
        assert torch.equal(a.reshape(-1).contiguous().view(torch.uint8), b.reshape(-1).view(torch.uint8))


def _round_trip(echo: Connection, slab: ShmSlab, obj: Any, threshold: int, as_torch: bool) -> dict[str, Any]:
    msg = pack(obj, slab, "echo", inline_threshold=threshold)
    echo.send_bytes((b"T" if as_torch else b"N") + msg)
    reply, reply_refs = unpack(echo.recv_bytes(), None, as_torch=as_torch)
    assert reply_refs == [] and isinstance(reply, dict)
    slab.ack(reply["acks"])
    return reply


@pytest.mark.parametrize("threshold", [0, 1 << 30], ids=["shm", "inline"])
def test_numpy_round_trip_bitwise(echo: Connection, launch_id: str, threshold: int) -> None:
    cases = _numpy_cases()
    with ShmSlab(launch_id, "prod", 1 << 20) as slab:
        reply = _round_trip(echo, slab, cases, threshold, as_torch=False)
        _assert_bitwise(cases, reply["obj"])
        num_tensors = 9
        assert len(reply["acks"]) == (num_tensors if threshold == 0 else 0)
        assert slab.num_live_slots == 0 and slab.num_used_bytes == 0


@pytest.mark.parametrize("threshold", [0, 1 << 30], ids=["shm", "inline"])
def test_torch_round_trip_bitwise(echo: Connection, launch_id: str, threshold: int) -> None:
    import torch

    torch.manual_seed(0)
    base = torch.randn(6, 5, 8, 7)
    cases = {
        "bf16_4d_noncontig": base.to(torch.bfloat16).permute(2, 0, 3, 1)[:, ::2],
        "bf16_0d": torch.tensor(1.5, dtype=torch.bfloat16),
        "f32_4d": base,
        "f16_empty": torch.zeros(3, 0, dtype=torch.float16),
        "i64": torch.arange(-500, 500),
        "u8": torch.randint(0, 256, (40, 40), dtype=torch.uint8),
        "bool": torch.rand(999) > 0.5,
    }
    with ShmSlab(launch_id, "prod", 1 << 20) as slab:
        reply = _round_trip(echo, slab, cases, threshold, as_torch=True)
        _assert_bitwise(cases, reply["obj"])
        assert len(reply["acks"]) == (len(cases) if threshold == 0 else 0)
        assert slab.num_live_slots == 0


def test_acked_region_is_reused_and_overflow_unlinked(echo: Connection, launch_id: str) -> None:
    with ShmSlab(launch_id, "prod", 64 * 1024) as slab:
        x = np.arange(4096, dtype=np.float32)  # 16 KiB
        msg = pack([x, x + 1, x + 2, x + 3, x + 4], slab, "echo", inline_threshold=0)
        assert slab.num_overflow_puts == 1  # 4 fill the 64 KiB slab, the 5th overflows
        segments = list_segments(launch_id)
        assert len(segments) == 2
        echo.send_bytes(b"N" + msg)
        reply, _ = unpack(echo.recv_bytes(), None)
        assert isinstance(reply, dict)
        for i, y in enumerate(reply["obj"]):
            assert np.array_equal(y, x + i)
        # NOTE: the reader caches the slab mapping but maps overflow segments per view.
        assert slab.segment in reply["mapped"] and not set(segments[1:]) & set(reply["mapped"])
        slab.ack(reply["acks"])
        assert slab.num_live_slots == 0
        assert list_segments(launch_id) == [slab.segment]
        first = slab.put(x, "echo")
        assert first.offset == 0 and not first.is_overflow
        slab.ack([first.slot_id])


def test_release_consumer_after_consumer_dies(launch_id: str) -> None:
    parent, child = CTX.Pipe()
    proc = CTX.Process(target=relay_workers.holding_consumer, args=(child,), daemon=True)
    proc.start()
    try:
        with ShmSlab(launch_id, "prod", 1 << 16) as slab:
            xs = [np.full(1000, float(i), np.float64) for i in range(3)]
            parent.send_bytes(pack(xs, slab, "holder", inline_threshold=0))
            sums, _ = unpack(parent.recv_bytes(), None)
            assert sums == [0.0, 1000.0, 2000.0]
            other = slab.put(np.ones(10, np.float32), "someone-else")
            os.kill(proc.pid, signal.SIGKILL)
            proc.join(timeout=10)
            assert slab.num_live_slots == 4
            assert slab.release_consumer("holder") == 3
            assert slab.release_consumer("holder") == 0
            assert slab.num_live_slots == 1
            slab.ack([other.slot_id])
            assert slab.num_used_bytes == 0
    finally:
        if proc.is_alive():
            proc.kill()


def test_sigkilled_producer_segments_are_swept(launch_id: str) -> None:
    parent, child = CTX.Pipe()
    proc = CTX.Process(target=relay_workers.crashing_producer, args=(child, launch_id), daemon=True)
    proc.start()
    segments = parent.recv()
    assert len(segments) == 2 and all(os.path.exists(os.path.join(SHM_DIR, s)) for s in segments)
    os.kill(proc.pid, signal.SIGKILL)
    proc.join(timeout=10)
    assert proc.exitcode == -signal.SIGKILL
    assert list_segments(launch_id) == sorted(segments)  # nothing unlinked them behind our back
    assert sweep(launch_id, owner="talker") == []  # another owner's prefix does not match
    assert sweep(launch_id, owner="talker-0") == sorted(segments)
    assert not [n for n in os.listdir(SHM_DIR) if n.startswith(f"vs-{launch_id}-")]
