"""`GET /metrics` after real native sessions (real uvicorn, real stage processes, speech-like audio):
first-audio latency, the per-stage breakdown, realtime factor, responses by status, barge-ins,
protocol errors and the active-session gauge; and the per-replica series of a replicated stage
(ready, restarts, requests in flight) as one replica dies and comes back."""

from __future__ import annotations

import json
import os
import signal
import time
from collections.abc import Callable, Iterator

import pytest
from harness import Pipeline, shm_segments
from live_server import LiveServer, events_until, metric, open_session, speech_pipeline, stream_audio
from speech_signals import signal_of

from voice_server.config import pipeline_from_dict
from voice_server.engine.requests import RequestError, RequestStream

RATE = 16000


@pytest.fixture(scope="module")
def server() -> Iterator[LiveServer]:
    pipeline = speech_pipeline(step_delay_ms=30)
    srv = LiveServer(pipeline)
    yield srv
    srv.close()
    pipeline.close()


def test_metrics_after_a_spoken_and_a_typed_turn(server: LiveServer) -> None:
    before = server.metrics()
    assert metric(before, "voice_server_first_audio_seconds_count") == 0
    ws = open_session(server.ws_url)
    assert metric(server.metrics(), "voice_server_active_sessions", endpoint="native") == 1
    stream_audio(ws, signal_of(RATE, ("noise", 300), ("voice", 900), ("noise", 700)), pace=4.0)
    events, _ = events_until(ws, "response_done")
    spoken = events[-1]
    assert spoken["status"] == "completed"
    ws.send(json.dumps({"type": "text", "text": "and now?"}))
    typed = events_until(ws, "response_done")[0][-1]
    ws.send(json.dumps({"type": "dance"}))
    assert json.loads(ws.recv(5))["code"] == "unknown_event"
    samples = server.metrics()
    print({k: v for k, v in samples.items() if "bucket" not in k[0]})
    assert metric(samples, "voice_server_first_audio_seconds_count") == 2
    assert metric(samples, "voice_server_first_audio_byte_seconds_count") == 2
    # The first audio comes one 30 ms step after the turn ends (plus the request's way through the
    # stage), and the response's own timings bound it: heard no sooner than sent.
    first_audio_sum = metric(samples, "voice_server_first_audio_seconds_sum")
    first_byte_sum = metric(samples, "voice_server_first_audio_byte_seconds_sum")
    assert 0.02 < first_byte_sum <= first_audio_sum < 2.0
    for key, total in (("first_audio_sent", first_byte_sum), ("first_audible", first_audio_sum)):
        assert total >= (spoken["timings_ms"][key] + typed["timings_ms"][key]) / 1e3
    # The reply gap (end of speech -> heard) is for the spoken turn only, and holds its silence window.
    assert metric(samples, "voice_server_reply_gap_seconds_count") == 1
    gap_ms = spoken["timings_ms"]["first_audible"] - spoken["timings_ms"]["end_of_speech"]
    assert "end_of_speech" not in typed["timings_ms"] and -2000 < spoken["timings_ms"]["end_of_speech"] <= 0
    assert metric(samples, "voice_server_reply_gap_seconds_sum") == pytest.approx(gap_ms / 1e3, abs=1e-3)
    assert metric(samples, "voice_server_stage_first_output_seconds_count", stage="speech") == 2
    stage_sum = metric(samples, "voice_server_stage_first_output_seconds_sum", stage="speech")
    assert stage_sum == pytest.approx((spoken["timings_ms"]["speech"] + typed["timings_ms"]["speech"]) / 1e3, abs=1e-3)
    for key in ("first_audio_sent", "first_audible", "end_of_speech"):
        assert metric(samples, "voice_server_stage_first_output_seconds_count", stage=key) == 0
    # 12 words of 80 ms audio at one word per 30 ms step: well under real time.
    assert metric(samples, "voice_server_realtime_factor_count") == 2
    assert 0.2 < metric(samples, "voice_server_realtime_factor_sum") / 2 < 0.9
    assert metric(samples, "voice_server_responses_total", status="completed") == 2
    assert metric(samples, "voice_server_protocol_errors_total", endpoint="native", type="unknown_event") == 1
    ws.close()
    deadline = time.monotonic() + 5
    while metric(server.metrics(), "voice_server_active_sessions", endpoint="native") != 0:
        assert time.monotonic() < deadline
        time.sleep(0.05)


def test_a_barge_in_is_counted_with_its_cancelled_response(server: LiveServer) -> None:
    before = server.metrics()
    ws = open_session(server.ws_url, params={"sampling": {"max_tokens": 200}})
    ws.send(json.dumps({"type": "text", "text": "tell me a long story"}))
    events_until(ws, "response_started")
    ws.recv(5)
    stream_audio(ws, signal_of(RATE, ("voice", 600), ("noise", 700)), pace=1.0)
    events, _ = events_until(ws, "response_done")
    assert events[-1]["status"] == "cancelled" and "item_truncated" in [e["type"] for e in events]
    events_until(ws, "response_done")  # the interruption's own reply
    after = server.metrics()
    assert metric(after, "voice_server_barge_ins_total") - metric(before, "voice_server_barge_ins_total") == 1
    cancelled = metric(after, "voice_server_responses_total", status="cancelled")
    assert cancelled - metric(before, "voice_server_responses_total", status="cancelled") == 1
    ws.close()


def test_two_apps_have_their_own_registries(server: LiveServer) -> None:
    ws = open_session(server.ws_url)
    other = LiveServer(server.pipeline)  # NOTE: the same series in a second app must not clash
    try:
        assert metric(other.metrics(), "voice_server_active_sessions", endpoint="native") == 0
        assert metric(server.metrics(), "voice_server_active_sessions", endpoint="native") == 1
        ws.close()
    finally:
        other.close()


Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]
REPLICA_SERIES = ("voice_server_replica_ready", "voice_server_replica_restarts_total", "voice_server_replica_inflight")


def replica_series(samples: Samples) -> dict[str, dict[str, float]]:
    """Series name -> process -> value, for the per-replica series of stage `tag`."""
    out: dict[str, dict[str, float]] = {name: {} for name in REPLICA_SERIES}
    for (name, labels), value in samples.items():
        if name in out:
            assert dict(labels)["stage"] == "tag", labels
            out[name][dict(labels)["process"]] = value
    return out


def scrape_until(srv: LiveServer, pred: Callable[[Samples], bool], timeout: float = 30.0) -> Samples:
    """Scrape until `pred` holds for the samples; returns them."""
    deadline = time.monotonic() + timeout
    while not pred(samples := srv.metrics()):
        assert time.monotonic() < deadline, replica_series(samples)
        time.sleep(0.02)
    return samples


def test_a_replicated_stage_reports_each_replica(server: LiveServer) -> None:
    # NOTE: the unreplicated speech pipeline has no replica series at all.
    assert not any(name.startswith("voice_server_replica_") for name, _ in server.metrics())
    # Stage `tag` at `replicas: 2`, the entry: a request with streamed input stays in flight until its input ends.
    pipeline = Pipeline(pipeline_from_dict({
        "name": "replicated", "restart_backoff_s": 0.5,
        "stages": [{"name": "tag", "factory": "fault_stages:create_pid_tagger", "terminal": True, "replicas": 2}],
    }))
    srv = LiveServer(pipeline)
    coordinator = pipeline.coordinator

    async def open_streams() -> list[RequestStream]:
        return [coordinator.submit({}, stream_input=True) for _ in range(3)]

    async def finish(stream: RequestStream) -> str:
        try:
            if stream.input is not None:
                stream.input.end()
            _ = [o async for o in stream]
        except RequestError as exc:
            return str(exc)
        return ""

    try:
        series = replica_series(srv.metrics())
        assert series == {"voice_server_replica_ready": {"tag@0": 1, "tag@1": 1},
                          "voice_server_replica_restarts_total": {"tag@0": 0, "tag@1": 0},
                          "voice_server_replica_inflight": {"tag@0": 0, "tag@1": 0}}
        streams = pipeline.run(open_streams())  # NOTE: least loaded first, ties in index order: 0, 1, 0
        assert replica_series(srv.metrics())["voice_server_replica_inflight"] == {"tag@0": 2, "tag@1": 1}
        victim = coordinator.launcher.handles["tag@1"]
        assert victim.pid is not None
        os.kill(victim.pid, signal.SIGKILL)
        # The dead replica is not ready and its request has failed; the pipeline stays ready on the other.
        down = scrape_until(srv, lambda s: metric(s, "voice_server_replica_ready", stage="tag", process="tag@1") == 0)
        assert replica_series(down)["voice_server_replica_ready"] == {"tag@0": 1, "tag@1": 0}
        assert replica_series(down)["voice_server_replica_inflight"] == {"tag@0": 2, "tag@1": 0}
        assert metric(down, "voice_server_pipeline_ready") == 1 and metric(down, "voice_server_inflight_requests") == 2
        back = scrape_until(srv, lambda s: metric(s, "voice_server_replica_ready", stage="tag", process="tag@1") == 1)
        assert replica_series(back) == {"voice_server_replica_ready": {"tag@0": 1, "tag@1": 1},
                                        "voice_server_replica_restarts_total": {"tag@0": 0, "tag@1": 1},
                                        "voice_server_replica_inflight": {"tag@0": 2, "tag@1": 0}}
        assert metric(back, "voice_server_stage_restarts_total", stage="tag") == 1
        errors = [pipeline.run(finish(stream)) for stream in streams]
        assert errors[0] == errors[2] == "" and "stage process 'tag@1' (tag) died" in errors[1], errors
        assert replica_series(srv.metrics())["voice_server_replica_inflight"] == {"tag@0": 0, "tag@1": 0}
    finally:
        srv.close()
        pipeline.close()
    assert shm_segments(coordinator.launch_id) == []
