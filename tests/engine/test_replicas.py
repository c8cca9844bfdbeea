"""Replicated stages (`replicas: N`): config, least-loaded routing, per-request stickiness, and a replica's death
failing only its requests."""

from __future__ import annotations

import asyncio
import os
import re
import signal
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
from harness import Pipeline, shm_segments, wait_for

from voice_server.config import BudgetError, ConfigError, format_budget, pipeline_from_dict, plan_budget
from voice_server.engine.coordinator import RequestError
from voice_server.engine.replicas import ReplicaPlanner, is_valid_plan

FRAMER = "voice_server.stages.numeric:create_framer"
TAGGER = "fault_stages:create_pid_tagger"


def raw_pipeline(**tagger: Any) -> dict[str, Any]:
    """framer --stream--> tag (terminal, 2 replicas): each client output names the pid that tagged it."""
    return {
        "name": "replicated", "restart_backoff_s": 0.05, "max_restart_backoff_s": 0.2,
        "stages": [
            {"name": "framer", "factory": FRAMER, "stream_to": ["tag"], "factory_args": {"frame_len": 4}},
            {"name": "tag", "factory": TAGGER, "terminal": True, "replicas": 2, **tagger},
        ],
    }


# -- config ----------------------------------------------------------------------------------------


def test_replicas_expand_into_one_process_each_named_with_the_index() -> None:
    cfg = pipeline_from_dict(raw_pipeline())
    assert cfg.stage("tag").process_names == ("tag@0", "tag@1")
    assert list(cfg.processes) == ["framer", "tag@0", "tag@1"]
    assert cfg.replicated_stages == ("tag",)
    assert cfg.stage("framer").process_names == ("framer",)


@pytest.mark.parametrize("value", [0, 65, True, 1.5, "2"])
def test_a_bad_replica_count_is_refused_naming_the_field(value: Any) -> None:
    with pytest.raises(ConfigError, match=r"stage 'tag'.*replicas.*\[1, 64\]"):
        pipeline_from_dict(raw_pipeline(replicas=value))


def test_a_replicated_stage_must_be_alone_in_its_process_group() -> None:
    raw = raw_pipeline(process="shared")
    raw["stages"][0]["process"] = "shared"
    with pytest.raises(ConfigError, match=r"stage 'tag'.*'replicas'.*alone in its process group.*framer"):
        pipeline_from_dict(raw)


def test_each_replica_holds_the_stage_memory_fraction_in_the_budget() -> None:
    raw = raw_pipeline(memory_fraction=0.4)
    raw["stages"][0]["memory_fraction"] = 0.3
    with pytest.raises(BudgetError, match=r"1\.100 > 1\.0 \(framer=0\.3, tag=0\.4x2\)"):
        plan_budget(pipeline_from_dict(raw))
    raw["stages"][0]["memory_fraction"] = 0.1
    table = format_budget(plan_budget(pipeline_from_dict(raw)))
    assert "0.4x2" in table and re.search(r"total cpu\s+cpu\s+0\.9\b", table), table


def test_the_planner_picks_the_least_loaded_ready_replica_and_forgets_ended_requests() -> None:
    cfg = pipeline_from_dict(raw_pipeline(replicas=3))
    ready = {"tag@0": True, "tag@1": True, "tag@2": False}
    planner = ReplicaPlanner(cfg, ready.__getitem__)
    plans = [planner.plan(f"r{i}")["tag"] for i in range(4)]
    assert plans == ["tag@0", "tag@1", "tag@0", "tag@1"]  # never the replica that is not ready
    planner.release("r0")
    planner.release("r2")
    assert planner.plan("r4") == {"tag": "tag@0"} and planner.requests_on("tag@1") == ["r1", "r3"]
    assert is_valid_plan(cfg, {"tag": "tag@2"})
    assert not is_valid_plan(cfg, {"tag": "framer"}) and not is_valid_plan(cfg, {"nope": "tag@0"})


# -- real processes --------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def replicated() -> Iterator[Pipeline]:
    pipeline = Pipeline(pipeline_from_dict(raw_pipeline()))
    yield pipeline
    launch_id = pipeline.coordinator.launch_id
    pipeline.close()
    assert shm_segments(launch_id) == []


def run_many(pipeline: Pipeline, num_requests: int, num_frames: int, delay_ms: float,
             on_first_output: Any = None) -> list[tuple[set[int], list[int], str]]:
    """Per request: the pids that tagged its chunks, the chunk indexes received, and its error ('' if none)."""
    coordinator = pipeline.coordinator

    async def one(i: int, first: asyncio.Event) -> tuple[set[int], list[int], str]:
        stream = coordinator.submit({"signal": np.arange(4 * num_frames, dtype=np.float32)},
                                    {"chunk_delay_ms": delay_ms})
        pids, indexes = set(), []
        try:
            async for output in stream:
                first.set()
                if "pid" in output.payload:
                    pids.add(output.payload["pid"])
                    indexes.append(output.payload["index"])
        except RequestError as exc:
            return pids, indexes, str(exc)
        return pids, indexes, ""

    async def go() -> list[tuple[set[int], list[int], str]]:
        first = asyncio.Event()
        tasks = [asyncio.ensure_future(one(i, first)) for i in range(num_requests)]
        if on_first_output is not None:
            await first.wait()
            await asyncio.sleep(0.1)
            on_first_output()
        return list(await asyncio.gather(*tasks))

    return pipeline.run(go(), timeout=120)


def replica_pids(pipeline: Pipeline) -> dict[int, str]:
    handles = pipeline.coordinator.launcher.handles
    return {h.pid: name for name, h in handles.items() if name.startswith("tag@") and h.pid is not None}


def test_concurrent_requests_split_between_replicas_each_sticking_to_one(replicated: Pipeline) -> None:
    results = run_many(replicated, 16, num_frames=6, delay_ms=5)
    pids = replica_pids(replicated)
    served = [replicated_by for result in results for replicated_by in result[0]]
    assert all(error == "" for _, _, error in results)
    assert all(indexes == list(range(6)) for _, indexes, _ in results)  # none lost, in order
    assert all(len(by) == 1 for by, _, _ in results)  # every chunk of a request on one replica
    assert sorted(pids[pid] for pid in served).count("tag@0") == 8  # 16 at once: 8 each
    health = replicated.coordinator.health()["stages"]["tag"]
    assert health["state"] == "ready" and health["num_ready_replicas"] == 2 and health["num_restarts"] == 0
    assert set(health["replicas"]) == {"tag@0", "tag@1"}
    assert all(r["num_inflight"] == 0 for r in health["replicas"].values())


def test_killing_one_replica_fails_only_its_requests(replicated: Pipeline) -> None:
    coordinator = replicated.coordinator
    victim = coordinator.launcher.handles["tag@0"]
    victim_pid, victim_generation = victim.pid, victim.generation
    assert victim_pid is not None
    pids = replica_pids(replicated)
    results = run_many(replicated, 16, num_frames=20, delay_ms=10,
                       on_first_output=lambda: os.kill(victim_pid, signal.SIGKILL))
    failed = [r for r in results if r[2]]
    completed = [r for r in results if not r[2]]
    # NOTE: the plan split them 8/8; the victim's requests fail (whatever they had received came from it).
    assert len(failed) == 8 and len(completed) == 8
    assert all("stage process 'tag@0' (tag) died" in error for _, _, error in failed)
    assert all(pids.get(pid) == "tag@0" for by, _, _ in failed for pid in by)
    assert all(len(by) == 1 and pids[next(iter(by))] == "tag@1" and indexes == list(range(20))
               for by, indexes, _ in completed)
    # NOTE: the dead replica's segments are swept; it restarts and takes requests again.
    assert not any(f"-tag@0.{victim_generation}-" in name for name in shm_segments(coordinator.launch_id))
    assert wait_for(lambda: coordinator.launcher.handles["tag@0"].state.value == "ready", 30)
    assert coordinator.launcher.handles["tag@0"].generation == victim_generation + 1
    after = run_many(replicated, 4, num_frames=3, delay_ms=0)
    new_pids = replica_pids(replicated)
    assert all(error == "" and indexes == [0, 1, 2] for _, indexes, error in after)
    assert {new_pids[pid] for by, _, _ in after for pid in by} == {"tag@0", "tag@1"}
    assert coordinator.num_inflight == 0


def test_a_client_streamed_input_reaches_one_replica_of_a_replicated_entry() -> None:
    raw = {"name": "entry", "stages": [{"name": "tag", "factory": TAGGER, "terminal": True, "replicas": 2}]}
    pipeline = Pipeline(pipeline_from_dict(raw))
    coordinator = pipeline.coordinator

    async def one() -> list[dict[str, Any]]:
        stream = coordinator.submit({}, stream_input=True)
        assert stream.input is not None
        for i in range(5):
            assert stream.input.send({"index": i})
            await asyncio.sleep(0.01)
        assert stream.input.end()
        return [o.payload for o in [o async for o in stream] if "pid" in o.payload]

    async def go() -> list[list[dict[str, Any]]]:
        return list(await asyncio.gather(*(one() for _ in range(4))))

    try:
        results = pipeline.run(go())
        pids = replica_pids(pipeline)
        assert all([p["index"] for p in r] == [0, 1, 2, 3, 4] for r in results)
        assert all(len({p["pid"] for p in r}) == 1 for r in results)  # every chunk on one replica
        assert {pids[r[0]["pid"]] for r in results} == {"tag@0", "tag@1"}
    finally:
        launch_id = coordinator.launch_id
        pipeline.close()
    assert shm_segments(launch_id) == []
