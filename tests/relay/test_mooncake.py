"""Cross-host relay on Mooncake Transfer Engine: a spawned producer (slab + router + exporter) and a reader in
this process, over real TCP sockets on 127.0.0.1 and real /dev/shm segments."""

from __future__ import annotations

import ctypes
import dataclasses
import errno
import multiprocessing as mp
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgpack
import numpy as np
import pytest

os.environ.setdefault("MC_LOG_LEVEL", "WARNING")  # NOTE: as voice_server's engines do; read when Mooncake loads
pytest.importorskip("mooncake.engine", reason="pip install mooncake-transfer-engine-non-cuda")

import torch  # noqa: E402

from voice_server.relay import (  # noqa: E402
    MooncakeReader,
    RelayReaders,
    RemoteRef,
    ShmReader,
    ShmRef,
    ShmSlab,
    sweep,
    unpack,
)
from voice_server.relay.codec import EXT_REMOTE_REF, EXT_SHM_REF, RelayReadError  # noqa: E402
from voice_server.relay.shm_segments import list_segments  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent))
import relay_workers  # noqa: E402

CTX = mp.get_context("spawn")
torch.set_num_threads(1)


class Producer:
    def __init__(self, launch_id: str) -> None:
        self.launch_id = launch_id
        self.conn, child = CTX.Pipe()
        self.proc = CTX.Process(target=relay_workers.mooncake_producer, args=(child, launch_id), daemon=True)
        self.proc.start()

    def call(self, cmd: str, arg: Any = None) -> Any:
        self.conn.send((cmd, arg))
        assert self.conn.poll(30), f"producer did not answer {cmd}"
        return self.conn.recv_bytes() if cmd == "pack" else self.conn.recv()

    def close(self) -> None:
        if self.proc.is_alive():
            assert self.call("close") is None
            self.proc.join(timeout=10)
            assert self.proc.exitcode == 0
        # NOTE: a clean close leaves nothing in /dev/shm; only a killed producer needs the coordinator's sweep.
        assert list_segments(self.launch_id) == []


@pytest.fixture(scope="module")
def producer() -> Iterator[Producer]:
    p = Producer(uuid.uuid4().hex[:12])
    yield p
    p.close()


@pytest.fixture(scope="module")
def readers() -> Iterator[RelayReaders]:
    # NOTE: a 64 KiB staging buffer: 4 KiB reads go through it, 1 MiB and 3 MiB into per-read buffers.
    r = RelayReaders(ShmReader(), lambda: MooncakeReader("127.0.0.1", staging_bytes=64 * 1024))
    yield r
    r.close()


def _ext_codes(msg: bytes) -> list[int]:
    codes: list[int] = []
    msgpack.unpackb(msg, ext_hook=lambda code, data: codes.append(code), strict_map_key=False)
    return codes


def _assert_bitwise(want: Any, have: Any) -> None:
    if isinstance(want, torch.Tensor):
        assert isinstance(have, torch.Tensor) and have.dtype == want.dtype and have.shape == want.shape
        assert torch.equal(have.reshape(-1).view(torch.uint8), want.reshape(-1).contiguous().view(torch.uint8))
    else:
        assert isinstance(have, np.ndarray) and have.dtype == want.dtype and have.shape == want.shape
        assert have.tobytes() == want.tobytes() and have.flags.writeable


@pytest.mark.parametrize("as_torch", [False, True], ids=["numpy", "torch"])
def test_remote_tensors_bitwise_and_acks_free_the_slab(
    producer: Producer, readers: RelayReaders, as_torch: bool
) -> None:
    msg = producer.call("pack", ("far", as_torch))
    cases = relay_workers.mooncake_cases(as_torch)
    assert _ext_codes(msg) == [EXT_REMOTE_REF] * len(cases)
    held = producer.call("stats")
    assert held["num_live_slots"] == len(cases) and held["num_overflow_puts"] >= 1
    assert len(held["registered"]) == 2  # the slab and the 3 MiB tensor's overflow segment
    obj, refs = unpack(msg, readers, as_torch=as_torch)
    assert isinstance(obj, dict) and obj.keys() == cases.keys()
    assert all(isinstance(r, RemoteRef) and r.owner == "prod" for r in refs)
    stats = producer.call("ack", [r.slot_id for r in refs])
    # NOTE: the tensors are copies: still intact after the ack freed (and unregistered) their slots.
    for name, want in cases.items():
        _assert_bitwise(want, obj[name])
    assert stats["num_live_slots"] == 0 and stats["num_used_bytes"] == 0
    assert stats["registered"] == list_segments(producer.launch_id) == [f"vs-{producer.launch_id}-prod-0"]
    reader = readers.remote_reader
    assert isinstance(reader, MooncakeReader) and reader.num_read_bytes >= sum(r.nbytes for r in refs)


def test_router_sends_shm_refs_to_local_consumers_remote_refs_to_remote(
    producer: Producer, readers: RelayReaders
) -> None:
    before = producer.call("stats")
    local, remote = producer.call("pack", ("near", False)), producer.call("pack", ("far", False))
    num_tensors = len(relay_workers.mooncake_cases(False))
    assert _ext_codes(local) == [EXT_SHM_REF] * num_tensors
    assert _ext_codes(remote) == [EXT_REMOTE_REF] * num_tensors
    obj_local, refs_local = unpack(local, readers)
    obj_remote, refs_remote = unpack(remote, readers)
    assert all(type(r) is ShmRef for r in refs_local) and all(type(r) is RemoteRef for r in refs_remote)
    assert isinstance(obj_local, dict) and isinstance(obj_remote, dict)
    for name in obj_local:
        _assert_bitwise(obj_local[name], obj_remote[name])
    nbytes = sum(r.nbytes for r in refs_remote)
    del obj_local
    stats = producer.call("ack", [r.slot_id for r in refs_local + refs_remote])
    assert stats["num_local_puts"] - before["num_local_puts"] == num_tensors
    assert stats["num_remote_puts"] - before["num_remote_puts"] == num_tensors
    assert stats["num_remote_bytes"] - before["num_remote_bytes"] == nbytes
    assert stats["num_exports"] == stats["num_remote_puts"] and stats["num_live_slots"] == 0


def test_release_consumer_frees_and_unregisters(producer: Producer, readers: RelayReaders) -> None:
    msg = producer.call("pack", ("far", False))
    num_tensors = len(relay_workers.mooncake_cases(False))
    assert producer.call("release", "far") == num_tensors
    stats = producer.call("stats")
    assert stats["num_live_slots"] == 0 and stats["num_used_bytes"] == 0
    assert len(stats["registered"]) == 1
    # NOTE: the overflow segment is gone, so its slot cannot be read any more; the rest still decodes.
    with pytest.raises(RelayReadError) as info:
        unpack(msg, readers)
    assert isinstance(info.value.cause, OSError) and "failed" in str(info.value.cause)
    assert len(info.value.refs) == num_tensors
    assert isinstance(info.value.obj, dict) and info.value.obj["f16_3m"] is None
    assert info.value.obj["i64_4k"] is not None


def test_read_after_producer_died_raises_relay_read_error(readers: RelayReaders) -> None:
    launch_id = uuid.uuid4().hex[:12]
    producer = Producer(launch_id)
    try:
        msg = producer.call("pack", ("far", False))
        segments = list_segments(launch_id)
        os.kill(producer.proc.pid, signal.SIGKILL)
        producer.proc.join(timeout=10)
        with pytest.raises(RelayReadError) as info:
            unpack(msg, readers)
        assert isinstance(info.value.cause, OSError)
        assert len(info.value.refs) == len(relay_workers.mooncake_cases(False))
    finally:
        if producer.proc.is_alive():
            producer.proc.kill()
    assert sweep(launch_id) == segments and len(segments) == 2  # what the coordinator does for a dead stage


def test_hung_producer_times_out_once_then_fails_fast(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MC_TRANSFER_TIMEOUT", "5")  # NOTE: Mooncake's minimum; read when an engine starts
    launch_id = uuid.uuid4().hex[:12]
    producer = Producer(launch_id)
    reader = MooncakeReader("127.0.0.1", staging_bytes=64 * 1024)
    try:
        # NOTE: one read first: a handshake with a hung peer never contacted waits Mooncake's fixed 60 s.
        _, refs = unpack(producer.call("pack", ("far", False)), RelayReaders(ShmReader(), lambda: reader))
        producer.call("ack", [r.slot_id for r in refs])
        msg = producer.call("pack", ("far", False))
        os.kill(producer.proc.pid, signal.SIGSTOP)
        t0 = time.monotonic()
        with pytest.raises(RelayReadError) as info:
            unpack(msg, RelayReaders(ShmReader(), lambda: reader))
        elapsed = time.monotonic() - t0
        assert isinstance(info.value.cause, OSError) and info.value.cause.errno == errno.ETIMEDOUT
        assert 5 <= elapsed < 9, elapsed  # NOTE: the first read waits the timeout, the others fail at once
        assert len(reader._abandoned) == 1  # noqa: SLF001  (the staging buffer the late bytes may land in)
        with pytest.raises(OSError, match="timed out .* ago"):
            reader.get(refs[-1])
    finally:
        producer.proc.kill()
        producer.proc.join(timeout=10)
        reader.close()
    assert len(sweep(launch_id)) == 2


def test_remote_ref_wire_and_reader_checks(readers: RelayReaders) -> None:
    slot = ShmRef("talker-0", "vs-x-talker-0-0", 128, 24, 7, "float32", (2, 3))
    ref = RemoteRef(slot, "10.0.0.2:15123", 0x7F00_0000_0080)
    wire = msgpack.unpackb(msgpack.packb(ref.to_wire()))
    assert RemoteRef.from_wire(wire) == ref and ref.slot_id == 7 and ref.owner == "talker-0"
    with pytest.raises(ValueError, match="does not match"):
        readers.get(RemoteRef(dataclasses.replace(slot, nbytes=25), ref.session, ref.address))
    with pytest.raises(OSError, match="no cross-host reader"):
        RelayReaders(ShmReader()).get(ref)
    # NOTE: no engine listens at this session: an OSError, not a hang or a crash.
    with pytest.raises(OSError, match="failed"):
        readers.get(dataclasses.replace(ref, session="127.0.0.1:9"))


def test_slab_observer_sees_every_segment_at_its_address() -> None:
    events: list[tuple[Any, ...]] = []

    class Recorder:
        def __init__(self, refuse_above: int | None = None) -> None:
            self.refuse_above = refuse_above

        def on_map(self, name: str, address: int, size: int) -> None:
            if self.refuse_above is not None and size > self.refuse_above:
                raise OSError(f"refused {size} B")
            events.append(("map", name, address, size))

        def on_unmap(self, name: str, address: int) -> None:
            events.append(("unmap", name, address))

    launch_id = uuid.uuid4().hex[:12]
    with ShmSlab(launch_id, "p", 4096) as slab:
        slab.put(np.arange(16, dtype=np.int64), "c")
        slab.set_observer(Recorder())  # NOTE: attached late: told at once of the slab mapped before
        assert events == [("map", slab.segment, events[0][2], 4096)]
        assert ctypes.string_at(events[0][2], 128) == np.arange(16, dtype=np.int64).tobytes()
        big = np.arange(2000, dtype=np.int32)
        ref = slab.put(big, "c")
        assert ref.is_overflow and events[-1][:2] == ("map", ref.segment) and events[-1][3] == big.nbytes
        assert ctypes.string_at(events[-1][2], big.nbytes) == big.tobytes()
        slab.ack([ref.slot_id])
        assert events[-1] == ("unmap", ref.segment, events[-2][2])
        slab.set_observer(None)
        assert events[-1] == ("unmap", slab.segment, events[0][2])
        with pytest.raises(OSError, match="refused"):
            slab.set_observer(Recorder(refuse_above=0))  # NOTE: refused, so not attached
        slab.set_observer(Recorder(refuse_above=4096))
        with pytest.raises(OSError, match="refused"):
            slab.put(big, "c")  # NOTE: its overflow segment is refused: dropped, nothing reserved
        assert slab.num_used_bytes == 128 and slab.num_overflow_segments == 0
        assert list_segments(launch_id) == [slab.segment]
    assert events[-1] == ("unmap", slab.segment, events[-2][2])
    with pytest.raises(OSError, match="refused"):
        ShmSlab(launch_id, "q", 4096, observer=Recorder(refuse_above=0))
    assert sweep(launch_id) == []


def test_relay_imports_without_mooncake() -> None:
    code = (
        "import sys\n"
        "import voice_server.relay as relay\n"
        "assert 'mooncake' not in sys.modules and 'mooncake.engine' not in sys.modules\n"
        "sys.modules['mooncake'] = None\n"
        "try:\n"
        "    relay.MooncakeReader('127.0.0.1')\n"
        "except RuntimeError as exc:\n"
        "    print(exc)\n"
        "readers = relay.RelayReaders(relay.ShmReader(), lambda: relay.MooncakeReader('127.0.0.1'))\n"
        "try:\n"
        "    readers.get(relay.RemoteRef(relay.ShmRef('p', 's', 0, 4, 0, 'float32', (1,)), '127.0.0.1:9', 4096))\n"
        "except OSError as exc:\n"  # NOTE: what the codec turns into a RelayReadError for that message
        "    print(exc)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60)
    lines = out.stdout.splitlines()
    assert len(lines) == 2 and all("pip install mooncake-transfer-engine-non-cuda" in line for line in lines), lines
