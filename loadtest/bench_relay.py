"""Relay vs msgpack vs pickle for moving one tensor between two processes, with memcpy as the ceiling.

Each variant sends a float32 tensor over a ZMQ PUSH socket (ipc) to a spawned consumer that decodes it,
reads a strided sample of ~256 elements spread over the whole tensor (so no variant is free) and replies
on a second PUSH socket; the relay's reply carries the slot ids the producer acks. Latency is that round
trip with one message in flight (median/p90); throughput (GB/s) keeps a window of up to 8 messages in
flight (as many as the relay's slab holds). Below 16 KiB the relay sends the tensor inline. memcpy is an
in-process `np.copyto` of the same size plus the same sample read (throughput = size / mean time).

A second table compares the cross-host transports with shared memory, every tensor through the transport
(inline threshold 0, so 4 KiB is relayed too): `shm` (the slab), `mooncake` (a `RelayRouter` whose consumer
is "remote": the consumer's `MooncakeReader` pulls the slot out of the producer's slab over Mooncake
Transfer Engine TCP, loopback here) and `gloo` (`DistSender` / `DistReceiver`, torch.distributed on
loopback). Same round trip, same window; the reply still acks over ZMQ ipc.

Usage: python loadtest/bench_relay.py [--quick] [--rounds N] [--no-cross-host]
"""

from __future__ import annotations

import argparse
import importlib.util
import multiprocessing as mp
import os
import pickle
import socket
import statistics
import time
import uuid
from collections.abc import Callable
from typing import Any

os.environ.setdefault("OMP_NUM_THREADS", "1")

import msgpack  # noqa: E402
import numpy as np  # noqa: E402
import zmq  # noqa: E402

from voice_server.relay import (  # noqa: E402
    ConsumerTransport,
    MooncakeExporter,
    ProducerTransport,
    RelayRouter,
    ShmReader,
    ShmSlab,
    pack,
    unpack,
)

SIZES = (4 * 1024, 1024 * 1024, 64 * 1024 * 1024)
ITERS = {4 * 1024: 2000, 1024 * 1024: 300, 64 * 1024 * 1024: 30}
QUICK_ITERS = {4 * 1024: 300, 1024 * 1024: 50, 64 * 1024 * 1024: 8}
VARIANTS = ("relay", "msgpack", "pickle")
# NOTE: every tensor through the transport (inline threshold 0); mooncake only where it is installed.
CROSS_HOST_VARIANTS = ("shm", "mooncake", "gloo")
_RELAYED = ("relay", *CROSS_HOST_VARIANTS)


def _touch(x: np.ndarray) -> float:
    flat = x.reshape(-1)
    return float(flat[:: max(1, flat.size // 256)].sum())


def _decode(variant: str, buf: bytes | memoryview, reader: ConsumerTransport) -> tuple[float, list[int]]:
    if variant in _RELAYED:
        obj, refs = unpack(buf, reader)
        assert isinstance(obj, dict)
        return _touch(obj["x"]), [r.slot_id for r in refs]
    if variant == "msgpack":
        obj = msgpack.unpackb(buf)
        arr = np.frombuffer(obj["data"], dtype=obj["dtype"]).reshape(obj["shape"])
        return _touch(arr), []
    return _touch(pickle.loads(buf)), []


def _reader(variant: str, gloo_port: int) -> ConsumerTransport:
    if variant == "mooncake":
        from voice_server.relay import MooncakeReader

        return MooncakeReader("127.0.0.1")
    if variant == "gloo":
        import torch.distributed as dist

        from voice_server.relay import DistReceiver

        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{gloo_port}", rank=1, world_size=2)
        return DistReceiver()
    return ShmReader()


def _consumer(variant: str, in_addr: str, out_addr: str, gloo_port: int = 0) -> None:
    ctx = zmq.Context()
    pull, push = ctx.socket(zmq.PULL), ctx.socket(zmq.PUSH)
    pull.connect(in_addr)
    push.connect(out_addr)
    reader = _reader(variant, gloo_port)
    # NOTE: each variant gets its best receive mode: relay messages are small (a copy is cheaper than a
    # zmq.Frame), the baselines are large (zero-copy frame).
    is_copy = variant in _RELAYED
    while True:
        msg = pull.recv(copy=is_copy)
        buf = msg if isinstance(msg, bytes) else msg.buffer
        if len(buf) == 0:
            break
        sample, slot_ids = _decode(variant, buf, reader)
        push.send(msgpack.packb([slot_ids, sample]))
    reader.close()
    if variant == "gloo":
        import torch.distributed as dist

        dist.destroy_process_group()
    ctx.destroy(linger=0)


def _encode(variant: str, x: np.ndarray, transport: ProducerTransport) -> bytes:
    if variant == "relay":
        return pack({"x": x}, transport, "bench")
    if variant in CROSS_HOST_VARIANTS:
        return pack({"x": x}, transport, "bench", inline_threshold=0)
    if variant == "msgpack":
        return msgpack.packb({"dtype": str(x.dtype), "shape": list(x.shape), "data": x.data})
    return pickle.dumps(x, protocol=pickle.HIGHEST_PROTOCOL)


def _time(fn: Callable[[], None], num_iters: int, num_warmup: int) -> list[float]:
    for _ in range(num_warmup):
        fn()
    times = []
    for _ in range(num_iters):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return times


def _row(variant: str, nbytes: int, times: list[float], gbps: float) -> dict[str, Any]:
    times_sorted = sorted(times)
    return {
        "variant": variant,
        "size_bytes": nbytes,
        "num_iters": len(times),
        "median_ms": statistics.median(times) * 1e3,
        "p90_ms": times_sorted[int(0.9 * (len(times) - 1))] * 1e3,
        "gbps": gbps,
    }


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _bench_variant(
    variant: str, x: np.ndarray, slab: ShmSlab, num_iters: int, router: RelayRouter | None = None
) -> tuple[list[float], float]:
    """`router` (mooncake): a RelayRouter over `slab` for which the consumer "bench" is remote."""
    tag = uuid.uuid4().hex[:10]
    in_addr, out_addr = f"ipc://@vsbench-{tag}-in", f"ipc://@vsbench-{tag}-out"
    ctx = zmq.Context()
    push, pull = ctx.socket(zmq.PUSH), ctx.socket(zmq.PULL)
    push.bind(in_addr)
    pull.bind(out_addr)
    gloo_port = _free_port() if variant == "gloo" else 0
    proc = mp.get_context("spawn").Process(target=_consumer, args=(variant, in_addr, out_addr, gloo_port),
                                           daemon=True)
    proc.start()
    transport: ProducerTransport = router if variant == "mooncake" and router is not None else slab
    if variant == "gloo":
        import torch.distributed as dist

        from voice_server.relay import DistSender

        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{gloo_port}", rank=0, world_size=2)
        transport = DistSender({"bench": 1})
    expected = _touch(x)

    def send() -> None:
        push.send(_encode(variant, x, transport), copy=False)

    def receive() -> None:
        slot_ids, sample = msgpack.unpackb(pull.recv())
        transport.ack(slot_ids)
        assert sample == expected, (variant, sample, expected)

    def round_trip() -> None:
        send()
        receive()

    try:
        times = _time(round_trip, num_iters, num_warmup=max(2, num_iters // 10))
        # Throughput: keep a window of messages in flight (as many as the slab holds, at most 8).
        window = max(1, min(8, slab.capacity_bytes // max(1, x.nbytes)))
        t0 = time.perf_counter()
        for _ in range(window):
            send()
        for i in range(num_iters):
            receive()
            if i + window < num_iters:
                send()
        gbps = num_iters * x.nbytes / (time.perf_counter() - t0) / 1e9
        assert slab.num_live_slots == 0 and slab.num_overflow_puts == 0
        assert getattr(transport, "num_live_slots", 0) == 0
    finally:
        push.send(b"")
        proc.join(timeout=10)
        if proc.is_alive():
            proc.kill()
        if variant == "gloo" and dist.is_initialized():
            dist.destroy_process_group()
        ctx.destroy(linger=0)
    return times, gbps


def run(quick: bool = False, sizes: tuple[int, ...] = SIZES, num_rounds: int = 3) -> list[dict[str, Any]]:
    """NOTE: the variants run in interleaved rounds so a burst of load on the shared box hits all of
    them; latency pools every round's samples, throughput is the median of the rounds'."""
    iters = QUICK_ITERS if quick else ITERS
    times: dict[tuple[int, str], list[float]] = {}
    gbps: dict[tuple[int, str], list[float]] = {}
    with ShmSlab(uuid.uuid4().hex[:10], "bench", 2 * max(sizes)) as slab:
        for _ in range(num_rounds):
            for nbytes in sizes:
                x = np.random.default_rng(0).standard_normal(nbytes // 4).astype(np.float32)
                num_iters = iters.get(nbytes, 20)
                for variant in VARIANTS:
                    t, g = _bench_variant(variant, x, slab, num_iters)
                    times.setdefault((nbytes, variant), []).extend(t)
                    gbps.setdefault((nbytes, variant), []).append(g)
                dst = np.empty_like(x)

                def memcpy(x: np.ndarray = x, dst: np.ndarray = dst) -> None:
                    np.copyto(dst, x)
                    _touch(dst)

                t = _time(memcpy, num_iters, num_warmup=2)
                times.setdefault((nbytes, "memcpy"), []).extend(t)
                gbps.setdefault((nbytes, "memcpy"), []).append(nbytes / statistics.fmean(t) / 1e9)
    return [_row(v, n, t, statistics.median(gbps[(n, v)])) for (n, v), t in times.items()]


def run_cross_host(quick: bool = False, sizes: tuple[int, ...] = SIZES, num_rounds: int = 3) -> list[dict[str, Any]]:
    """shm vs mooncake vs gloo, interleaved rounds as in `run`; mooncake is left out when not installed."""
    iters = QUICK_ITERS if quick else ITERS
    variants = [v for v in CROSS_HOST_VARIANTS if v != "mooncake" or importlib.util.find_spec("mooncake")]
    times: dict[tuple[int, str], list[float]] = {}
    gbps: dict[tuple[int, str], list[float]] = {}
    with ShmSlab(uuid.uuid4().hex[:10], "bench", 2 * max(sizes)) as slab:
        router = RelayRouter(slab, {"bench"}, lambda: MooncakeExporter("127.0.0.1"))
        try:
            for _ in range(num_rounds):
                for nbytes in sizes:
                    x = np.random.default_rng(0).standard_normal(nbytes // 4).astype(np.float32)
                    for variant in variants:
                        t, g = _bench_variant(variant, x, slab, iters.get(nbytes, 20), router)
                        times.setdefault((nbytes, variant), []).extend(t)
                        gbps.setdefault((nbytes, variant), []).append(g)
        finally:
            router.close()
    return [_row(v, n, t, statistics.median(gbps[(n, v)])) for (n, v), t in times.items()]


def _fmt_size(nbytes: int) -> str:
    return f"{nbytes // (1 << 20)} MiB" if nbytes >= 1 << 20 else f"{nbytes // 1024} KiB"


def _cell(row: dict[str, Any]) -> str:
    return f"{row['median_ms']:9.3f} /{row['p90_ms']:9.3f} ({row['gbps']:7.2f})"


def format_table(rows: list[dict[str, Any]]) -> str:
    by_key = {(r["size_bytes"], r["variant"]): r for r in rows}
    variants = (*VARIANTS, "memcpy")
    head = f"{'size':>7} | " + " | ".join(f"{v + ' med/p90 ms (GB/s)':>32}" for v in variants)
    head += " | relay speedup (latency / throughput) vs msgpack, pickle | relay/memcpy (lat / thr)"
    lines = [head, "-" * len(head)]
    for nbytes in sorted({r["size_bytes"] for r in rows}):
        cells = [_cell(by_key[(nbytes, v)]) for v in variants]
        med = {v: by_key[(nbytes, v)]["median_ms"] for v in variants}
        gbps = {v: by_key[(nbytes, v)]["gbps"] for v in variants}
        ratios = (f"{med['msgpack'] / med['relay']:5.1f}x / {gbps['relay'] / gbps['msgpack']:5.1f}x, "
                  f"{med['pickle'] / med['relay']:5.1f}x / {gbps['relay'] / gbps['pickle']:5.1f}x"
                  f" | {med['relay'] / med['memcpy']:5.2f}x / {gbps['memcpy'] / gbps['relay']:5.2f}x")
        lines.append(f"{_fmt_size(nbytes):>7} | " + " | ".join(f"{c:>32}" for c in cells) + " | " + ratios)
    return "\n".join(lines)


def format_cross_host_table(rows: list[dict[str, Any]]) -> str:
    by_key = {(r["size_bytes"], r["variant"]): r for r in rows}
    variants = [v for v in CROSS_HOST_VARIANTS if any(r["variant"] == v for r in rows)]
    others = [v for v in variants if v != "shm"]
    head = f"{'size':>7} | " + " | ".join(f"{v + ' med/p90 ms (GB/s)':>32}" for v in variants)
    head += " | " + ", ".join(others) + " slowdown vs shm (latency / throughput)"
    lines = [head, "-" * len(head)]
    for nbytes in sorted({r["size_bytes"] for r in rows}):
        cells = [_cell(by_key[(nbytes, v)]) for v in variants]
        shm = by_key[(nbytes, "shm")]
        ratios = ", ".join(f"{by_key[(nbytes, v)]['median_ms'] / shm['median_ms']:6.1f}x / "
                           f"{shm['gbps'] / by_key[(nbytes, v)]['gbps']:6.1f}x" for v in others)
        lines.append(f"{_fmt_size(nbytes):>7} | " + " | ".join(f"{c:>32}" for c in cells) + " | " + ratios)
    return "\n".join(lines)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer iterations")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds per variant")
    parser.add_argument("--no-cross-host", action="store_true", help="skip the shm / mooncake / gloo table")
    args = parser.parse_args()
    from table import cpu_description

    rows = run(quick=args.quick, num_rounds=args.rounds)
    cross_rows = [] if args.no_cross_host else run_cross_host(quick=args.quick, num_rounds=args.rounds)
    # NOTE: on a shared box, the load average explains most of the variance between runs.
    load = ", ".join(f"{v:.2f}" for v in os.getloadavg())
    print(cpu_description())
    print(f"{os.cpu_count()} CPUs, load average {load}, OMP_NUM_THREADS={os.environ['OMP_NUM_THREADS']}")
    print(format_table(rows))
    if cross_rows:
        print("\nCross-host transports on loopback, every tensor relayed (inline threshold 0):")
        print(format_cross_host_table(cross_rows))
