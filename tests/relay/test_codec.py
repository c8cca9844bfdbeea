"""Tensor byte views and the msgpack codec within one process."""

from __future__ import annotations

import pickle
import subprocess
import sys
import uuid
from collections.abc import Iterator

import msgpack
import numpy as np
import pytest

from voice_server.relay import ShmReader, ShmSlab, pack, sweep, unpack
from voice_server.relay.tensors import as_bytes_view, from_buffer


@pytest.fixture()
def launch_id() -> Iterator[str]:
    lid = uuid.uuid4().hex[:12]
    yield lid
    assert sweep(lid) == []


DTYPES = ["float32", "float16", "float64", "int64", "int32", "int16", "uint8", "bool"]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(), (0,), (7,), (2, 3, 4, 5)])
def test_numpy_bytes_view_round_trip(dtype: str, shape: tuple[int, ...]) -> None:
    x = (np.arange(int(np.prod(shape))) % 3).astype(dtype).reshape(shape)
    name, got_shape, raw = as_bytes_view(x)
    assert (name, got_shape, raw.nbytes) == (dtype, shape, x.nbytes)
    if x.size:
        assert np.shares_memory(np.frombuffer(raw, np.uint8), x)  # contiguous: no copy
    y = from_buffer(raw, name, got_shape, as_torch=False)
    assert isinstance(y, np.ndarray) and y.dtype == x.dtype and y.tobytes() == x.tobytes()


def test_non_contiguous_and_bfloat16() -> None:
    import torch

    x = np.arange(24, dtype=np.int32).reshape(2, 3, 4).transpose(2, 0, 1)
    name, shape, raw = as_bytes_view(x)
    assert np.array_equal(np.frombuffer(raw, np.int32).reshape(shape), x)
    t = torch.randn(4, 6).to(torch.bfloat16)[:, ::2]
    name, shape, raw = as_bytes_view(t)
    assert (name, shape) == ("bfloat16", (4, 3))
    wide = from_buffer(raw, name, shape, as_torch=False)  # numpy has no bfloat16: exactly widened to float32
    assert isinstance(wide, np.ndarray) and wide.dtype == np.float32 and np.array_equal(wide, t.float().numpy())
    back = from_buffer(bytearray(raw), name, shape, as_torch=True)
    assert isinstance(back, torch.Tensor) and back.dtype == torch.bfloat16 and torch.equal(back, t)


def test_pack_inline_below_threshold_shm_above(launch_id: str) -> None:
    with ShmSlab(launch_id, "p", 1 << 20) as slab:
        reader = ShmReader()
        small, big = np.arange(10, dtype=np.float32), np.arange(5000, dtype=np.float32)
        msg = pack({"small": small, "big": big, "t": (1, "a", b"b", None, 2.5), "n": np.float32(0.5)},
                   slab, "c", inline_threshold=16384)
        assert slab.num_live_slots == 1
        obj, refs = unpack(msg, reader)
        assert isinstance(obj, dict)
        assert [r.nbytes for r in refs] == [big.nbytes]
        assert np.array_equal(obj["small"], small) and np.array_equal(obj["big"], big)
        assert obj["t"] == [1, "a", b"b", None, 2.5] and obj["n"] == 0.5  # tuples come back as lists
        assert not obj["small"].flags.writeable  # inline: a view on the message bytes
        with pytest.raises(ValueError, match="no reader"):
            unpack(msg, None)
        no_slab = pack({"big": big}, None, "c")
        obj2, refs2 = unpack(no_slab, None)
        assert refs2 == [] and isinstance(obj2, dict) and np.array_equal(obj2["big"], big)
        del obj
        slab.ack([r.slot_id for r in refs])
        reader.close()


def test_a_router_without_a_cross_host_engine_sends_remote_tensors_inline(launch_id: str) -> None:
    """The fallback when Mooncake is not installed (`engine/transports.py`): a consumer on another node gets the
    bytes inside the message; one on this node still gets a shared-memory reference."""
    from voice_server.relay.router import RelayReaders, RelayRouter

    with ShmSlab(launch_id, "p", 1 << 20) as slab:
        router, readers = RelayRouter(slab, {"far"}), RelayReaders(ShmReader())
        big = np.arange(5000, dtype=np.float32)
        obj, refs = unpack(pack({"big": big}, router, "far"), readers)
        assert refs == [] and slab.num_live_slots == 0
        assert isinstance(obj, dict) and np.array_equal(obj["big"], big)
        obj, refs = unpack(pack({"big": big}, router, "near"), readers)
        assert len(refs) == 1 and slab.num_live_slots == 1
        assert isinstance(obj, dict) and np.array_equal(obj["big"], big)
        del obj
        router.ack([r.slot_id for r in refs])
        readers.close()


def test_failed_pack_frees_its_slots(launch_id: str) -> None:
    with ShmSlab(launch_id, "p", 1 << 20) as slab:
        with pytest.raises(TypeError, match="object"):
            pack([np.zeros(10000), object()], slab, "c", inline_threshold=0)
        assert slab.num_live_slots == 0


def test_no_pickle_on_the_wire() -> None:
    msg = pack({"x": np.arange(3)}, None, "c")
    with pytest.raises(pickle.UnpicklingError):
        pickle.loads(msg)
    assert isinstance(msgpack.unpackb(msg, strict_map_key=False)["x"], msgpack.ExtType)


def test_numpy_only_consumer_never_imports_torch() -> None:
    code = (
        "import sys, numpy as np\n"
        "from voice_server.relay import ShmSlab, ShmReader, pack, unpack, sweep\n"
        "import uuid; lid = uuid.uuid4().hex[:12]\n"
        "s = ShmSlab(lid, 'p', 1 << 20); r = ShmReader()\n"
        "obj, refs = unpack(pack({'a': np.ones(9000)}, s, 'c'), r)\n"
        "assert obj['a'].sum() == 9000 and len(refs) == 1\n"
        "del obj; r.close(); s.close()\n"
        "print('torch' in sys.modules)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
