"""Admission limits under a burst far beyond them, in a process with a 1,024-descriptor limit."""

from __future__ import annotations

import pytest
from harness import Pipeline
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
    assert result["complete"] + result["overload_later"] + result["gave_up"] == 8192
    assert result["complete"] >= 8192 * 0.9
    assert set(result["generations"].values()) == {0}  # no stage died
    assert result["num_inflight"] == 0 and set(result["live_slots"].values()) == {0}
    assert result["fds_after"] == result["fds_before"]
    assert result["shm_leftover"] == []


def test_a_stage_whose_relay_is_full_fails_that_request_as_overload_and_lives() -> None:
    raw = {
        "name": "amp", "relay_slab_bytes": 1 << 20, "max_relay_bytes": 1 << 20, "max_relay_segments": 2,
        "stages": [
            {"name": "amp", "factory": "fault_stages:create_amplifier", "stream_to": ["sink"]},
            # The sink holds every chunk until the request leaves it, so the amplifier's relay fills.
            {"name": "sink", "factory": "voice_server.stages.numeric:create_sink", "terminal": True,
             "factory_args": {}},
        ],
    }
    pipeline = Pipeline(pipeline_from_dict(raw))
    try:
        with pytest.raises(OverloadError, match="stage 'amp'.*relay of amp.0 is full"):
            pipeline.collect({"num_chunks": 80, "chunk_bytes": 32 << 10})  # 2.5 MiB > 1 MiB
        outputs = pipeline.collect({"num_chunks": 4, "chunk_bytes": 32 << 10})
        assert pipeline.coordinator.launcher.handles["amp"].generation == 0
    finally:
        pipeline.close()
    assert len(outputs) == 5 and outputs[-1].payload == {"num_frames": 4}
