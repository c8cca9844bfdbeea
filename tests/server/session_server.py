"""`SessionServer`: a `LiveServer` (real uvicorn on 127.0.0.1, in this process on the coordinator's loop)
over real stage processes, by default the stand-in speech stage (`tests/speech_stages.py`), for the
session endpoint tests (`/ws`, `/v1/realtime`, `/twilio/media`). A test can read a stage's counters
(e.g. that a vanished client's request left the stage).
"""

from __future__ import annotations

import time
from collections.abc import Iterator

from harness import Pipeline, shm_segments
from live_server import LiveServer, speech_pipeline

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


def serve(pipeline: Pipeline | None = None, stage: str = "speech",
          limits: SessionLimits | None = None) -> Iterator[SessionServer]:
    """The body of a module-scoped fixture: one server per test module, checked for leaks at the end."""
    srv = SessionServer(pipeline, stage, limits)
    yield srv
    srv.close()
    assert shm_segments(srv.pipeline.coordinator.launch_id) == []
