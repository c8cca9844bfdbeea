"""The tiny Qwen3-Omni pipeline of tests/runners/test_omni_pipeline.py with its vocoder replicated
(`code2wav` at `replicas: 2`, issue #23), against the same transformers reference.

- 16 requests submitted at once split 8/8 between `code2wav@0` and `code2wav@1` (least-loaded planning at
  submit: `voice_server/engine/replicas.py`), seen as `/health`'s `num_inflight` per replica right after the
  submits and as the streams and frames each replica decoded (its scheduler's counters: exactly those of the
  requests planned on it). Every request streams what the reference generates, whichever replica decoded it.
- SIGKILL of one replica mid-audio, 16 requests in flight: exactly the 8 planned on it fail, naming it; the
  other 8 complete equal to the reference; the replica restarts (generation 1), later requests use both, and
  no shared-memory segment of the dead one is left.
"""

from __future__ import annotations

import asyncio
import os
import signal
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
from harness import Pipeline, shm_segments, wait_for
from omni_reference import LIMITS, TinyOmni, omni_config

from voice_server.config import pipeline_from_dict
from voice_server.engine.requests import RequestError, RequestStream

torch.set_num_threads(1)
REPLICAS = ("code2wav@0", "code2wav@1")
NUM_REQUESTS = 16
KILL_LIMITS = (12, 16)
"""Reply tokens and frames in the kill test: every reply streams several vocoder chunks (the first has
`initial_chunk_frames`, 2), so a request's first audio is never its last and the kill lands mid-audio."""

Job = tuple[int, int, int]
"""(index into `omni_cases()`, reply tokens, frames)."""


@pytest.fixture(scope="module")
def omni(reference: TinyOmni) -> Iterator[Pipeline]:
    cfg = omni_config(reference.ckpt)
    # NOTE: a short backoff: the killed replica is back in the time its model takes to load.
    cfg.update(restart_backoff_s=0.05, max_restart_backoff_s=0.2)
    next(s for s in cfg["stages"] if s["name"] == "code2wav")["replicas"] = 2
    pipeline = Pipeline(pipeline_from_dict(cfg))
    yield pipeline
    launch_id = pipeline.coordinator.launch_id
    pipeline.close()
    assert shm_segments(launch_id) == []


def code2wav_counters(omni: Pipeline) -> dict[str, dict[str, int]]:
    """Each ready replica's vocoder scheduler counters (`num_streams_done`, `num_frames_decoded`, ...)."""
    stats = omni.run(omni.coordinator.stats())
    return {p: stats[p].counters["code2wav"] for p in REPLICAS if p in stats}


def delta(after: dict[str, dict[str, int]], before: dict[str, dict[str, int]], key: str) -> dict[str, int]:
    return {p: after[p][key] - before[p][key] for p in REPLICAS}


def run_jobs(
    omni: Pipeline, reference: TinyOmni, prefix: str, jobs: list[Job],
    on_output: Callable[[int, Any], None] | None = None,
) -> tuple[dict[str, int], list[list[Any] | RequestError]]:
    """Submit every job at once (request ids `{prefix}{i}`; see the NOTE below on reusing one); returns each
    replica's `num_inflight` in `/health` right after the submits, and each request's outputs or the
    RequestError that ended it. `on_output(i, output)` sees every output as it arrives."""
    coordinator = omni.coordinator

    async def drain(i: int, stream: RequestStream) -> list[Any] | RequestError:
        outputs = []
        try:
            async for output in stream:
                outputs.append(output)
                if on_output is not None:
                    on_output(i, output)
        except RequestError as exc:
            return exc
        return outputs

    async def go() -> tuple[dict[str, int], list[list[Any] | RequestError]]:
        # NOTE: no await between the submits: each plan sees every request planned before it. Each run has its
        # own ids: the coordinator refuses the id of a request it aborted or failed.
        params = [{"sampling": {"max_tokens": n}, "talker": {"max_frames": f}} for _, n, f in jobs]
        streams = [coordinator.submit(reference.cases[case][0], params[i], request_id=f"{prefix}{i}")
                   for i, (case, _, _) in enumerate(jobs)]
        replicas = coordinator.health()["stages"]["code2wav"]["replicas"]
        planned = {p: replicas[p]["num_inflight"] for p in REPLICAS}
        return planned, list(await asyncio.gather(*(drain(i, s) for i, s in enumerate(streams))))

    return omni.run(go(), timeout=240)


def test_sixteen_requests_split_between_the_replicas_and_stream_what_the_reference_generates(
    omni: Pipeline, reference: TinyOmni
) -> None:
    # Every case twice, the second time with other limits: 16 different turns.
    jobs = [(i % 8, *LIMITS[i % 8 if i < 8 else (i + 3) % 8]) for i in range(NUM_REQUESTS)]
    before = code2wav_counters(omni)
    planned, results = run_jobs(omni, reference, "split-", jobs)
    after = code2wav_counters(omni)
    for (case, n, f), got in zip(jobs, results, strict=True):
        assert not isinstance(got, RequestError), got
        reference.check(case, n, f, got)
    # NOTE: an idle pipeline plans in index order among equals, so request i is on code2wav@(i % 2).
    frames = {p: sum(reference.turn(*jobs[i])[1].shape[-1] for i in range(k, NUM_REQUESTS, 2))
              for k, p in enumerate(REPLICAS)}
    print(f"planned {planned}; streams decoded {delta(after, before, 'num_streams_done')}; "
          f"frames decoded {delta(after, before, 'num_frames_decoded')} (reference {frames})")
    assert planned == {"code2wav@0": 8, "code2wav@1": 8}
    assert delta(after, before, "num_streams_done") == {"code2wav@0": 8, "code2wav@1": 8}
    assert delta(after, before, "num_frames_decoded") == frames
    assert all(c["num_streams"] == 0 for c in after.values())
    health = omni.coordinator.health()
    assert health["num_inflight"] == 0
    assert all(r["num_inflight"] == 0 for r in health["stages"]["code2wav"]["replicas"].values())


def test_killing_one_replica_mid_audio_fails_only_its_requests(omni: Pipeline, reference: TinyOmni) -> None:
    coordinator = omni.coordinator
    victim = coordinator.launcher.handles["code2wav@1"]
    victim_pid, victim_generation = victim.pid, victim.generation
    assert victim_pid is not None
    jobs = [(i % 8, *KILL_LIMITS) for i in range(NUM_REQUESTS)]
    assert all(reference.turn(*job)[1].shape[-1] > 2 for job in jobs)  # NOTE: see KILL_LIMITS

    def segments_of(generation: int) -> list[str]:
        return [n for n in shm_segments(coordinator.launch_id) if f"-code2wav@1.{generation}-" in n]

    assert segments_of(victim_generation)  # NOTE: its relay slab, so the sweep below is seen
    at_kill: dict[str, int] = {}

    def kill_at_its_first_audio(i: int, output: Any) -> None:
        # NOTE: the first audio of a request planned on the victim (odd i): none of the victim's requests has
        # ended yet (their first audio is not their last), so all 8 must fail.
        if not at_kill and i % 2 == 1 and output.stage == "code2wav":
            os.kill(victim_pid, signal.SIGKILL)
            replicas = coordinator.health()["stages"]["code2wav"]["replicas"]
            at_kill.update({"request": i, "inflight": coordinator.num_inflight,
                            **{p: replicas[p]["num_inflight"] for p in REPLICAS}})

    planned, results = run_jobs(omni, reference, "kill-", jobs, on_output=kill_at_its_first_audio)
    print(f"killed code2wav@1 at the first audio of request {at_kill.get('request')}: {at_kill}")
    assert planned == {"code2wav@0": 8, "code2wav@1": 8} and at_kill["code2wav@1"] == 8
    failed = {i for i, got in enumerate(results) if isinstance(got, RequestError)}
    assert failed == set(range(1, NUM_REQUESTS, 2)), failed
    for i in failed:
        assert "stage process 'code2wav@1' (code2wav) died" in str(results[i]), results[i]
    for i in set(range(NUM_REQUESTS)) - failed:
        got = results[i]
        assert not isinstance(got, RequestError)
        reference.check(*jobs[i], got)
    # NOTE: the dead replica's segments are swept at once; it restarts as generation 1 and serves again.
    assert segments_of(victim_generation) == []
    assert wait_for(lambda: coordinator.launcher.handles["code2wav@1"].state.value == "ready", 60)
    assert segments_of(victim_generation + 1)
    entry = coordinator.health()["stages"]["code2wav"]["replicas"]["code2wav@1"]
    assert entry["state"] == "ready" and entry["generation"] == victim_generation + 1 == 1
    assert entry["num_restarts"] == 1 and entry["num_inflight"] == 0
    before = code2wav_counters(omni)
    later = [(0, *LIMITS[0]), (5, *LIMITS[5]), (3, *LIMITS[3]), (6, *LIMITS[6])]
    planned, results = run_jobs(omni, reference, "later-", later)
    assert planned == {"code2wav@0": 2, "code2wav@1": 2}
    for job, got in zip(later, results, strict=True):
        assert not isinstance(got, RequestError), got
        reference.check(*job, got)
    assert delta(code2wav_counters(omni), before, "num_streams_done") == {"code2wav@0": 2, "code2wav@1": 2}
    assert coordinator.num_inflight == 0
