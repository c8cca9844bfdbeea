"""`SessionServer`: a real uvicorn server on 127.0.0.1 serving the app over real stage processes that run
the stand-in speech stage (`tests/speech_stages.py`), for the session endpoint tests (`/ws`,
`/v1/realtime`, `/twilio/media`).

uvicorn runs in this process, on the coordinator's loop, so a test can read the stages' counters
(e.g. that a vanished client's request left the stage).
"""

from __future__ import annotations

import asyncio
import socket
import time
from collections.abc import Iterator
from typing import Any

import uvicorn
from harness import Pipeline, shm_segments

from voice_server.config import pipeline_from_dict
from voice_server.server.app import create_app

STEP_DELAY_MS = 30  # NOTE: each step streams 80 ms of audio: faster than real time, slow enough to interrupt


class SessionServer:
    def __init__(self) -> None:
        self.pipeline = Pipeline(pipeline_from_dict({"name": "speech-test", "stages": [{
            "name": "speech", "factory": "speech_stages:create_fake_speech", "scheduler": "ar", "terminal": True,
            "max_batch_size": 8, "max_step_tokens": 64, "factory_args": {"step_delay_ms": STEP_DELAY_MS},
        }]}))
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = int(s.getsockname()[1])
        config = uvicorn.Config(create_app(self.pipeline.coordinator), host="127.0.0.1", port=self.port,
                                log_level="warning", ws_max_size=1 << 20, lifespan="off")
        self.server = uvicorn.Server(config)
        self.task = asyncio.run_coroutine_threadsafe(self.server.serve(), self.pipeline.lt.loop)
        deadline = time.monotonic() + 10
        while not self.server.started:
            assert time.monotonic() < deadline and not self.task.done(), "uvicorn did not start"
            time.sleep(0.02)

    def counters(self) -> dict[str, int]:
        return self.pipeline.run(self.pipeline.coordinator.stats())["speech"].counters["speech"]

    @property
    def app(self) -> Any:
        """The served app (its state holds endpoint settings, e.g. `app.state.twilio`)."""
        return self.server.config.app

    def wait_idle(self, timeout: float = 10.0) -> None:
        """Until no request runs in the stage and its KV pages are all free."""
        deadline = time.monotonic() + timeout
        while (stats := self.counters())["num_running"] or stats["num_used_pages"]:
            assert time.monotonic() < deadline, stats
            time.sleep(0.05)

    def close(self) -> None:
        self.server.should_exit = True
        self.task.result(10)
        self.pipeline.close()


def serve() -> Iterator[SessionServer]:
    """The body of a module-scoped fixture: one server per test module, checked for leaks at the end."""
    srv = SessionServer()
    yield srv
    srv.close()
    assert shm_segments(srv.pipeline.coordinator.launch_id) == []
