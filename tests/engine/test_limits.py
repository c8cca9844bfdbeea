"""Admission limits under a burst far beyond them, in a process with a 1,024-descriptor limit: what is
admitted completes (a stage whose relay is full waits for room), the rest is refused at submit."""

from __future__ import annotations

import time

import numpy as np
import pytest
import yaml
from harness import CONFIGS, Pipeline
from scenarios import run_scenario

from voice_server.config import pipeline_from_dict
from voice_server.engine.coordinator import OverloadError


def test_burst_beyond_admission_limits_completes_or_fails_typed_and_leaks_nothing() -> None:
    result = run_scenario("burst", nofile=1024, timeout_s=600)
    print(result)
    assert result["max_inflight_requests"] == 256 and result["max_relay_segments"] == 128
    assert result["wrong"] == 0 and result["other_error"] == 0, result["errors"]
    # Beyond 256 in flight (or a full coordinator relay) submit refuses at once; clients retry.
    assert result["num_refusals"] >= 8192 - 256
    assert result["overload_later"] == 0 and result["gave_up"] == 0 and result["complete"] == 8192
    assert set(result["generations"].values()) == {0}  # no stage died
    assert result["num_inflight"] == 0 and set(result["live_slots"].values()) == {0}
    assert result["fds_after"] == result["fds_before"]
    assert result["shm_leftover"] == []


@pytest.mark.parametrize("scenario", ["burst_once_1024", "burst_once_2048", "resubmit_mib"])
def test_admitted_requests_complete_and_the_rest_is_refused_at_submit(scenario: str) -> None:
    # NOTE: bursts of up to 1 MiB requests sent once, and 64 workers resubmitting 1 MiB requests: the
    # stages' relays fill (128 overflow segments each) long before the 256 requests in flight do.
    result = run_scenario(scenario, nofile=1024, timeout_s=400)
    print(result)
    num_requests = {"burst_once_1024": 1024, "burst_once_2048": 2048}.get(scenario)
    assert result["overload_later"] == 0 and result["other_error"] == 0 and result["wrong"] == 0, result["errors"]
    if num_requests is None:
        assert result["complete"] == 64 * 4
    else:
        assert result["complete"] + result["refused"] == num_requests and result["complete"] >= 64
    assert set(result["generations"].values()) == {0}
    assert set(result["live_slots"].values()) == {0} and result["shm_leftover"] == []


def test_a_long_stream_completes_while_its_reader_keeps_up() -> None:
    # NOTE: 4,000 outputs, 4x the queue bound: the framer emits every frame of the request in one step.
    raw = yaml.safe_load((CONFIGS / "test_numeric.yaml").read_text())
    raw["stages"][0]["factory_args"] = {"frame_len": 4}
    pipeline = Pipeline(pipeline_from_dict(raw))
    try:
        signal = np.arange(4 * 4000, dtype=np.float32)
        outputs = pipeline.collect({"signal": signal})
    finally:
        pipeline.close()
    assert len(outputs) == 4001 and pipeline.coordinator.limits.max_queued_outputs == 1024
    assert np.array_equal(np.concatenate([o.payload["frame"] for o in outputs[:-1]]), signal * 2 + 1)


def test_a_stage_whose_relay_stays_full_fails_that_request_as_overload_and_lives() -> None:
    raw = {
        "name": "amp", "relay_slab_bytes": 1 << 20, "max_relay_bytes": 1 << 20, "max_relay_segments": 2,
        "max_relay_wait_s": 0.5,
        "stages": [
            {"name": "amp", "factory": "fault_stages:create_amplifier", "stream_to": ["sink"]},
            # The sink holds every chunk until the request leaves it, so the amplifier's relay fills.
            {"name": "sink", "factory": "voice_server.stages.numeric:create_sink", "terminal": True,
             "factory_args": {}},
        ],
    }
    pipeline = Pipeline(pipeline_from_dict(raw))
    try:
        full = r"stage 'amp'.*relay of amp.0 is full.*after 0.5 s \(max_relay_wait_s\)"
        with pytest.raises(OverloadError, match=full):
            pipeline.collect({"num_chunks": 80, "chunk_bytes": 32 << 10})  # 2.5 MiB > 1 MiB
        deadline = time.monotonic() + 10
        while pipeline.run(pipeline.coordinator.stats())["amp"].num_live_slots:  # the sink's acks
            assert time.monotonic() < deadline
            time.sleep(0.02)
        outputs = pipeline.collect({"num_chunks": 4, "chunk_bytes": 32 << 10})
        assert pipeline.coordinator.launcher.handles["amp"].generation == 0
    finally:
        pipeline.close()
    assert len(outputs) == 5 and outputs[-1].payload == {"num_frames": 4}
