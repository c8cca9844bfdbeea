"""`SessionServer`: a `LiveServer` (real uvicorn on 127.0.0.1, in this process on the coordinator's loop)
over real stage processes, by default the stand-in speech stage (`tests/speech_stages.py`), for the
session endpoint tests (`/ws`, `/v1/realtime`, `/twilio/media`). A test can read a stage's counters
(e.g. that a vanished client's request left the stage).
"""

from __future__ import annotations

import time
from collections.abc import Iterator

from harness import Pipeline, shm_segments, wait_for
from live_server import LiveServer, metric, speech_pipeline

from voice_server.server.session_limits import SessionLimits

STEP_DELAY_MS = 30  # NOTE: each step streams 80 ms of audio: faster than real time, slow enough to interrupt


class SessionServer(LiveServer):
    def __init__(self, pipeline: Pipeline | None = None, stage: str = "speech",
                 limits: SessionLimits | None = None) -> None:
        super().__init__(pipeline or speech_pipeline(STEP_DELAY_MS), limits)
        self.stage = stage
        """The AR stage whose counters `counters` and `wait_idle` read."""

    def counters(self, stage: str | None = None) -> dict[str, int]:
        name = stage or self.stage
        stats = self.pipeline.run(self.pipeline.coordinator.stats())
        return next(reply.counters[name] for reply in stats.values() if name in reply.counters)

    def wait_idle(self, timeout: float = 10.0, stage: str | None = None) -> None:
        """Until no request runs in the stage and its KV pages are all free."""
        deadline = time.monotonic() + timeout
        while (stats := self.counters(stage))["num_running"] or stats["num_used_pages"]:
            assert time.monotonic() < deadline, stats
            time.sleep(0.05)

    def close(self) -> None:
        super().close()
        self.pipeline.close()


Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def num_dropped(samples: Samples) -> float:
    """Sessions the server closed on its own (idle, slow_client, shutdown), all endpoints."""
    return sum(value for (name, _), value in samples.items() if name == "voice_server_sessions_dropped_total")


def check_vanished_client_aborted(server: SessionServer, before: Samples) -> None:
    """After a client vanished mid-reply (no close frame; `before`: the metrics before it asked for the
    reply): the server noticed the connection end by itself, closed the session, which cancelled the
    reply (a cancelled response in the metrics), and the reply's request left the stage.

    NOTE: the waits are 3 s: the replies of these tests take 12 s to finish (400 words at 30 ms a step)
    and a send to a client that stops reading gives up only after 10 s (`send_timeout_s`), so neither
    the reply ending nor a send timing out can free the stage in time: only the disconnect can."""
    server.wait_idle(timeout=3.0)

    def num_cancelled(samples: Samples) -> float:
        return metric(samples, "voice_server_responses_total", status="cancelled") - metric(
            before, "voice_server_responses_total", status="cancelled")

    def cancelled() -> Samples | None:
        samples = server.metrics()
        return samples if num_cancelled(samples) else None

    after = wait_for(cancelled, timeout=3.0)
    assert after is not None, "the vanished client's reply was not cancelled"
    assert num_cancelled(after) == 1
    assert metric(after, "voice_server_responses_total", status="completed") == metric(
        before, "voice_server_responses_total", status="completed")
    assert num_dropped(after) == num_dropped(before)  # NOTE: the client left; the server dropped no one
    assert metric(after, "voice_server_inflight_requests") == 0


def serve(pipeline: Pipeline | None = None, stage: str = "speech",
          limits: SessionLimits | None = None) -> Iterator[SessionServer]:
    """The body of a module-scoped fixture: one server per test module, checked for leaks at the end."""
    srv = SessionServer(pipeline, stage, limits)
    yield srv
    srv.close()
    assert shm_segments(srv.pipeline.coordinator.launch_id) == []
