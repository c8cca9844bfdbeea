"""torch.distributed (gloo) transport between two spawned processes."""

from __future__ import annotations

import multiprocessing as mp
import socket
import sys
from pathlib import Path

import torch

from voice_server.relay import unpack

sys.path.insert(0, str(Path(__file__).parent))
import relay_workers  # noqa: E402


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_gloo_point_to_point_round_trip_bitwise() -> None:
    ctx = mp.get_context("spawn")
    ctrl0, ctrl1 = ctx.Pipe()
    results = [ctx.Pipe(duplex=False) for _ in range(2)]
    port = _free_port()
    procs = [
        ctx.Process(target=relay_workers.dist_worker, args=(rank, port, ctrl, results[rank][1]), daemon=True)
        for rank, ctrl in ((0, ctrl0), (1, ctrl1))
    ]
    for p in procs:
        p.start()
    try:
        assert all(r[0].poll(60) for r in results), "a gloo worker did not report"
        sent, _ = unpack(results[0][0].recv_bytes(), None)
        got, _ = unpack(results[1][0].recv_bytes(), None, as_torch=True)
        for p in procs:
            p.join(timeout=30)
            assert p.exitcode == 0
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
    cases = relay_workers.dist_cases()
    assert sent == {"num_in_flight": len(cases) + 1, "num_live_slots": 0}
    assert isinstance(got, dict)
    assert got.pop("num_codec_refs") == 1
    codec = got.pop("codec")
    assert codec["n"] == 7 and torch.equal(codec["small"], cases["i64"][:4])
    assert torch.equal(codec["big"], cases["f32"])
    assert got.keys() == cases.keys()
    for name, want in cases.items():
        have = got[name]
        want_t = torch.from_numpy(want.copy()) if not isinstance(want, torch.Tensor) else want
        assert have.dtype == want_t.dtype and have.shape == want_t.shape, name
        assert torch.equal(have.reshape(-1).view(torch.uint8), want_t.reshape(-1).contiguous().view(torch.uint8))
