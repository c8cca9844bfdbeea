"""Supervision: startup failures, budget refusal before any spawn, a stage killed mid-stream."""

from __future__ import annotations

import asyncio
import multiprocessing
import os
import signal
import time
from typing import Any

import numpy as np
import pytest
from harness import CONFIGS, Pipeline, assert_start_fails, shm_segments, wait_for

from voice_server.config import BudgetError, load_pipeline, pipeline_from_dict
from voice_server.engine.coordinator import Coordinator, RequestError


def test_budget_refused_before_any_process_starts() -> None:
    raw = {
        "name": "greedy",
        "stages": [
            {"name": "a", "factory": "voice_server.stages.numeric:create_echo", "next": "b", "memory_fraction": 0.6},
            {"name": "b", "factory": "voice_server.stages.numeric:create_echo", "terminal": True,
             "memory_fraction": 0.5},
        ],
    }
    before = set(multiprocessing.active_children())
    with pytest.raises(BudgetError, match=r"a=0.6, b=0.5"):
        Coordinator(pipeline_from_dict(raw))
    assert set(multiprocessing.active_children()) == before


def test_startup_failure_names_the_stage_and_leaves_nothing_behind() -> None:
    raw = {
        "name": "broken",
        "startup_timeout_s": 30,
        "stages": [
            {"name": "good", "factory": "voice_server.stages.numeric:create_echo", "next": "bad"},
            {"name": "bad", "factory": "voice_server.stages.no_such_module:create", "terminal": True},
        ],
    }
    assert_start_fails(pipeline_from_dict(raw), "stage process 'bad'.*no_such_module")


def test_killed_stage_fails_its_requests_restarts_and_leaks_no_shm() -> None:
    pipeline = Pipeline(load_pipeline(CONFIGS / "test_numeric.yaml"))
    coordinator = pipeline.coordinator
    try:
        victim = coordinator.launcher.handles["transform"]
        old_pid = victim.pid
        assert old_pid is not None

        async def scenario() -> tuple[str, list[Any]]:
            # Large frames so the transform stage owns live relay segments when it dies.
            stream = coordinator.submit({"signal": np.ones(4096 * 100, np.float32)}, {"chunk_delay_ms": 20})
            received = [await stream.__anext__()]
            os.kill(old_pid, signal.SIGKILL)
            try:
                async for out in stream:
                    received.append(out)
            except RequestError as exc:
                return str(exc), received
            return "", received

        error, received = pipeline.run(scenario())
        assert "stage process 'transform'" in error and "died" in error
        assert len(received) < 100

        deadline = time.monotonic() + 60
        while not (coordinator.is_ready and victim.generation == 1):
            assert time.monotonic() < deadline, coordinator.health()
            time.sleep(0.05)
        assert victim.pid != old_pid and victim.num_restarts == 1
        dead_owner = f"vs-{coordinator.launch_id}-transform.0-"
        assert [n for n in shm_segments(coordinator.launch_id) if n.startswith(dead_owner)] == []

        signal_ok = np.arange(4096 * 3, dtype=np.float32)
        outputs = pipeline.collect({"signal": signal_ok})
        assert [o.payload.get("index") for o in outputs[:-1]] == [0, 1, 2]
        np.testing.assert_array_equal(outputs[1].payload["frame"], signal_ok[4096:8192] * 2 + 1)

        def slots_free() -> dict[str, Any] | None:
            stats = pipeline.run(coordinator.stats())
            return stats if all(r.num_live_slots == 0 for r in stats.values()) else None

        stats = wait_for(slots_free) or pipeline.run(coordinator.stats())  # NOTE: slots free asynchronously
        assert all(r.num_live_slots == 0 for r in stats.values()), stats
    finally:
        pipeline.close()
    assert shm_segments(coordinator.launch_id) == []
    for handle in coordinator.launcher.handles.values():
        assert handle.process is not None and not handle.process.is_alive()


def test_tensors_of_many_dtypes_round_trip_bitwise_through_the_engine() -> None:
    raw = {"name": "echo", "stages": [
        {"name": "echo", "factory": "voice_server.stages.numeric:create_echo", "terminal": True}]}
    pipeline = Pipeline(pipeline_from_dict(raw))
    rng = np.random.default_rng(7)
    payload = {
        "f32": rng.standard_normal((3, 5)).astype(np.float32),
        "f16_big": rng.standard_normal((64, 300)).astype(np.float16),  # 38 KiB: relay
        "i64": rng.integers(-(2**62), 2**62, size=(7,), dtype=np.int64),
        "u8_big": rng.integers(0, 255, size=(1 << 20,), dtype=np.uint8),  # 1 MiB: relay
        "bool": rng.random((4, 4)) > 0.5,
        "empty": np.zeros((0, 3), np.float32),
        "scalar": np.array(3.5, np.float64),
        "strided": rng.standard_normal((64, 128)).astype(np.float32)[:, ::2],  # 32 KiB non-contiguous
        "meta": {"text": "hello", "n": 3, "nested": [np.arange(5, dtype=np.int32)]},
    }
    try:
        outputs = pipeline.collect(payload)
    finally:
        pipeline.close()
    assert len(outputs) == 1 and outputs[0].is_final
    got = outputs[0].payload
    for key in ("f32", "f16_big", "i64", "u8_big", "bool", "empty", "scalar", "strided"):
        assert got[key].dtype == payload[key].dtype and got[key].shape == payload[key].shape, key
        assert got[key].tobytes() == payload[key].tobytes(), key
    assert got["meta"]["text"] == "hello" and got["meta"]["n"] == 3
    np.testing.assert_array_equal(got["meta"]["nested"][0], np.arange(5, dtype=np.int32))


def test_control_plane_over_tcp() -> None:
    raw = {"name": "tcp", "control_transport": "tcp", "stages": [
        {"name": "framer", "factory": "voice_server.stages.numeric:create_framer", "stream_to": ["sink"],
         "factory_args": {"frame_len": 8}},
        {"name": "sink", "factory": "voice_server.stages.numeric:create_sink", "terminal": True}]}
    pipeline = Pipeline(pipeline_from_dict(raw))
    try:
        assert all(a.startswith("tcp://127.0.0.1:") for a in pipeline.coordinator.endpoints.inboxes.values())
        signal_in = np.arange(20, dtype=np.float32)
        outputs = pipeline.collect({"signal": signal_in})
    finally:
        pipeline.close()
    assert [o.payload.get("index") for o in outputs] == [0, 1, 2, None]
    np.testing.assert_array_equal(outputs[2].payload["frame"], signal_in[16:])


def test_a_raising_batch_fails_only_the_bad_request() -> None:
    # NOTE: batches of exactly three: the 60 s window only ever closes because the batch is full, so
    # each group of three below is one batch however slow the machine is.
    raw = {"name": "echo", "stages": [
        {"name": "echo", "factory": "voice_server.stages.numeric:create_echo", "terminal": True,
         "max_batch_size": 3, "batch_window_ms": 60000}]}
    pipeline = Pipeline(pipeline_from_dict(raw))

    async def one(payload: dict[str, Any]) -> Any:
        try:
            return [o.payload async for o in pipeline.coordinator.submit(payload)]
        except RequestError as exc:
            return exc

    async def batch(*payloads: dict[str, Any]) -> list[Any]:
        return list(await asyncio.gather(*(one(p) for p in payloads)))

    try:
        # One batch that raises because of the middle request; each is then retried alone.
        good1, bad, good3 = pipeline.run(batch({"n": 1}, {"n": 2, "poison": True}, {"n": 3}))
        unencodable = pipeline.run(batch(*[{"emit_unencodable": True}] * 3))
        after = pipeline.run(batch({"n": 4}, {"n": 5}, {"n": 6}))
        assert pipeline.coordinator.is_ready
    finally:
        pipeline.close()
    assert good1 == [{"n": 1}] and good3 == [{"n": 3}]
    assert isinstance(bad, RequestError) and "ValueError: poisoned input" in str(bad)
    assert all(isinstance(u, RequestError) and "output cannot be sent" in str(u) for u in unencodable)
    assert after == [[{"n": 4}], [{"n": 5}], [{"n": 6}]]
