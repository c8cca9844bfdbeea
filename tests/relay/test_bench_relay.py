"""Smoke test: the relay benchmark runs end to end (real processes, real sockets) and reports sane rows."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

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


def test_bench_relay_cross_host_quick_run() -> None:
    """shm, Mooncake (TCP on loopback) and gloo, each relaying every tensor."""
    if importlib.util.find_spec("mooncake") is None:  # NOTE: not imported here: it must load in the bench's way
        pytest.skip("pip install mooncake-transfer-engine-non-cuda")
    rows = bench_relay.run_cross_host(quick=True, sizes=(64 * 1024,), num_rounds=1)
    assert [r["variant"] for r in rows] == ["shm", "mooncake", "gloo"]
    for r in rows:
        assert r["size_bytes"] == 64 * 1024 and r["num_iters"] == 20
        assert 0 < r["median_ms"] <= r["p90_ms"] and r["gbps"] > 0
    assert "mooncake, gloo slowdown vs shm" in bench_relay.format_cross_host_table(rows)
