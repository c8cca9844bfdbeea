"""Smoke test: the relay benchmark runs end to end (real processes, real sockets) and reports sane rows."""

from __future__ import annotations

import sys
from pathlib import Path

# NOTE: imported by name (not from a file spec) so spawned consumers can unpickle its functions.
sys.path.insert(0, str(Path(__file__).parents[2] / "loadtest"))
import bench_relay  # noqa: E402


def test_bench_relay_quick_run() -> None:
    rows = bench_relay.run(quick=True, sizes=(64 * 1024,), num_rounds=1)
    assert [r["variant"] for r in rows] == ["relay", "msgpack", "pickle", "memcpy"]
    for r in rows:
        assert r["size_bytes"] == 64 * 1024 and r["num_iters"] == 20
        assert 0 < r["median_ms"] <= r["p90_ms"] and r["gbps"] > 0
    assert "relay speedup" in bench_relay.format_table(rows)
