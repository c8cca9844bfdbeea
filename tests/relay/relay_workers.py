"""Child-process entry points for the relay tests (spawned, so they live in an importable module)."""

from __future__ import annotations

import os
from multiprocessing.connection import Connection
from typing import Any

os.environ.setdefault("OMP_NUM_THREADS", "1")

import numpy as np  # noqa: E402

from voice_server.relay import ShmReader, ShmSlab, pack, unpack  # noqa: E402


def echo_consumer(conn: Connection) -> None:
    """Unpacks each message (first byte: b"T" torch / b"N" numpy), replies with an inline copy.

    The reply carries the slot ids to ack, as the engine would send them back to the owner.
    """
    reader = ShmReader()
    while True:
        data = conn.recv_bytes()
        if not data:
            break
        as_torch = data[:1] == b"T"
        if as_torch:
            import torch

            torch.set_num_threads(1)
        obj, refs = unpack(data[1:], reader, as_torch=as_torch)
        reply = pack({"obj": obj, "acks": [r.slot_id for r in refs], "mapped": reader.mapped_segments},
                     None, "producer")
        del obj
        conn.send_bytes(reply)
    reader.close()
    conn.close()


def holding_consumer(conn: Connection) -> None:
    """Views every tensor it receives and never acks; reports the sum of each so it really read them."""
    reader = ShmReader()
    held = []
    while True:
        data = conn.recv_bytes()
        obj, refs = unpack(data, reader)
        held.append(obj)
        conn.send_bytes(pack([float(np.asarray(x, dtype=np.float64).sum()) for x in obj], None, "p"))


def crashing_producer(conn: Connection, launch_id: str) -> None:
    """Creates a slab plus an overflow segment, reports their names, then waits to be SIGKILLed."""
    slab = ShmSlab(launch_id, "talker-0", 4096)
    refs = [slab.put(np.ones(1024, np.float32), "c"), slab.put(np.ones(2048, np.float32), "c")]
    conn.send([r.segment for r in refs])
    conn.recv()


def dist_cases() -> dict[str, Any]:
    import torch

    g = torch.Generator().manual_seed(0)
    base = torch.randn(6, 5, 8, 7, generator=g)
    return {
        "bf16_4d_noncontig": base.to(torch.bfloat16).permute(2, 0, 3, 1)[:, ::2],
        "bf16_0d": torch.tensor(-2.5, dtype=torch.bfloat16),
        "f32": base,
        "f16_empty": torch.zeros(0, 3, dtype=torch.float16),
        "i64": torch.arange(-1000, 1000),
        "u8": torch.randint(0, 256, (33, 17), dtype=torch.uint8, generator=g),
        "bool": torch.rand(777, generator=g) > 0.5,
        "np_f32_noncontig": base.numpy()[:, ::2, 1],
    }


def dist_worker(rank: int, port: int, ctrl: Connection, result: Connection) -> None:
    """rank 0 sends every case to rank 1 over gloo; the refs and acks travel over `ctrl` (a Pipe)."""
    import msgpack
    import torch
    import torch.distributed as dist

    from voice_server.relay.dist import DistReceiver, DistRef, DistSender

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        if rank == 0:
            sender = DistSender({"rank1": 1})
            cases = dist_cases()
            refs = {k: sender.put(v, "rank1").to_wire() for k, v in cases.items()}
            ctrl.send_bytes(msgpack.packb(refs))
            # The codec path: big tensors become DistRefs inside an ordinary control message.
            ctrl.send_bytes(pack({"big": cases["f32"], "small": cases["i64"][:4], "n": 7}, sender, "rank1",
                                 inline_threshold=1024))
            num_in_flight = sender.num_live_slots
            sender.ack(msgpack.unpackb(ctrl.recv_bytes()))
            result.send_bytes(pack({"num_in_flight": num_in_flight, "num_live_slots": sender.num_live_slots},
                                   None, "test"))
        else:
            receiver = DistReceiver()
            wire = msgpack.unpackb(ctrl.recv_bytes())
            refs = {k: DistRef.from_wire(v) for k, v in wire.items()}
            got = {k: receiver.recv(ref, src_rank=0, as_torch=not k.startswith("np_")) for k, ref in refs.items()}
            msg, msg_refs = unpack(ctrl.recv_bytes(), receiver, as_torch=True)
            assert isinstance(msg, dict)
            got["codec"] = msg
            ctrl.send_bytes(msgpack.packb([r.slot_id for r in [*refs.values(), *msg_refs]]))
            got["num_codec_refs"] = len(msg_refs)
            result.send_bytes(pack(got, None, "test"))
        dist.barrier()
    finally:
        dist.destroy_process_group()


def mooncake_cases(as_torch: bool) -> dict[str, Any]:
    """Tensors for the cross-host relay tests: 0-d, empty, strided, 4 KiB, 1 MiB, and 3 MiB (more than the
    producer's 2 MiB slab, so it goes to an overflow segment)."""
    rng = np.random.default_rng(1)
    base = rng.standard_normal((6, 5, 8, 7)).astype(np.float32)
    cases: dict[str, Any] = {
        "f32_0d": np.array(3.25, np.float32),
        "f32_empty": np.zeros((0, 4), np.float32),
        "f32_4d_noncontig": base.transpose(2, 0, 3, 1)[:, ::2],
        "i64_4k": rng.integers(-(2**62), 2**62, 512, dtype=np.int64),
        "u8_1m": rng.integers(0, 256, (1024, 1024), dtype=np.uint8),
        "f16_3m": rng.standard_normal(3 << 19).astype(np.float16),
        "bool": rng.random(777) > 0.5,
    }
    if as_torch:
        import torch

        torch.set_num_threads(1)
        cases = {k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in cases.items()}
        cases["bf16_2d"] = torch.from_numpy(base.reshape(30, 56)).to(torch.bfloat16)
    return cases


def mooncake_producer(conn: Connection, launch_id: str) -> None:
    """A 2 MiB slab behind a RelayRouter whose consumer "far" is on another node (Mooncake on 127.0.0.1).

    Commands (pickled tuples on `conn`): ("pack", (consumer, as_torch)) replies with the packed message of
    `mooncake_cases`; ("ack", slot_ids) and ("stats", None) with the slab's and router's counters;
    ("release", consumer) with the number of slots freed; ("close", None) closes everything and exits.
    """
    from voice_server.relay import MooncakeExporter, RelayRouter

    slab = ShmSlab(launch_id, "prod", 2 << 20)
    router = RelayRouter(slab, {"far"}, lambda: MooncakeExporter("127.0.0.1"))

    def stats() -> dict[str, Any]:
        exporter = router.exporter
        return {
            "num_live_slots": slab.num_live_slots, "num_used_bytes": slab.num_used_bytes,
            "num_overflow_puts": slab.num_overflow_puts, "num_local_puts": router.num_local_puts,
            "num_remote_puts": router.num_remote_puts, "num_remote_bytes": router.num_remote_bytes,
            "num_exports": exporter.num_exports if exporter else 0,
            "registered": exporter.registered_segments if exporter else [],
        }

    while True:
        cmd, arg = conn.recv()
        if cmd == "pack":
            consumer, as_torch = arg
            conn.send_bytes(pack(mooncake_cases(as_torch), router, consumer, inline_threshold=0))
        elif cmd == "ack":
            router.ack(arg)
            conn.send(stats())
        elif cmd == "stats":
            conn.send(stats())
        elif cmd == "release":
            conn.send(router.release_consumer(arg))
        elif cmd == "close":
            router.close()
            conn.send(None)
            break
