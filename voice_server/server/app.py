"""The HTTP/WebSocket front: a starlette app over a coordinator, and the uvicorn server that runs it.

`serve` (`voice_server/server/runner.py`) owns the coordinator: the port listens first, the stages
load meanwhile (`/health` answers 503 with each stage's progress, sessions are closed with 1013),
and on a stop signal the open sessions are closed (1001) before the stages stop.

Routes: `GET /health` (200 only when every stage process is ready), `GET /metrics` (Prometheus text,
`voice_server/server/metrics.py`), `WS /ws`, the native voice protocol
(`voice_server/session/native.py`), `WS /v1/realtime`, the OpenAI Realtime protocol
(`voice_server/session/realtime/endpoint.py`), and `WS /twilio/media`, phone calls over Twilio Media
Streams (`voice_server/session/twilio/endpoint.py`; its settings, e.g. the token, in
`app.state.twilio`), and last `GET /` and the files under it: the browser demo
(`voice_server/server/web.py`, from `web_dir`, by default the repository's `web/`).

App state: `coordinator`, `metrics` (`Metrics`, one registry per app), `sessions` (`SessionGate`:
admission and limits every WebSocket endpoint applies) and `twilio` (`TwilioSettings`).
"""

from __future__ import annotations

import logging
import socket
import threading
from pathlib import Path

import uvicorn
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Mount, Route, WebSocketRoute

from voice_server.engine.coordinator import Coordinator
from voice_server.server.metrics import CONTENT_TYPE_LATEST, Metrics
from voice_server.server.session_limits import SessionLimits
from voice_server.server.sessions import AbortHandleMiddleware, SessionGate
from voice_server.server.web import WebFiles, default_web_dir
from voice_server.session.connection import MetricsSource, SessionAdmission
from voice_server.session.native import native_ws
from voice_server.session.realtime.endpoint import realtime_ws
from voice_server.session.semantic_vad import shared_models
from voice_server.session.twilio.endpoint import twilio_ws
from voice_server.session.twilio.settings import TwilioSettings

log = logging.getLogger(__name__)


async def health(request: Request) -> JSONResponse:
    coordinator: Coordinator = request.app.state.coordinator
    return JSONResponse(coordinator.health(), status_code=200 if coordinator.is_ready else 503)


async def metrics(request: Request) -> Response:
    return Response(request.app.state.metrics.render(), media_type=CONTENT_TYPE_LATEST)


def create_app(
    coordinator: Coordinator, limits: SessionLimits | None = None, twilio: TwilioSettings | None = None,
    web_dir: Path | None = None,
) -> Starlette:
    # NOTE: the demo's mount at `/` matches every path, so it goes last.
    routes = [Route("/health", health), Route("/metrics", metrics), WebSocketRoute("/ws", native_ws),
              WebSocketRoute("/v1/realtime", realtime_ws), WebSocketRoute("/twilio/media", twilio_ws),
              Mount("/", WebFiles(web_dir or default_web_dir()))]
    app = Starlette(routes=routes, middleware=[Middleware(AbortHandleMiddleware)])
    app_metrics = Metrics()
    app_metrics.watch(coordinator)
    gate = SessionGate(limits or SessionLimits(), app_metrics, lambda: coordinator.is_ready)
    # NOTE: the endpoints (`voice_server/session/`) never import the server: they see these through the app's
    # state as the Protocols of `voice_server/session/connection.py`; the annotations make mypy check that the
    # server's classes conform.
    sessions: SessionAdmission = gate
    tracking: MetricsSource = app_metrics
    app.state.coordinator, app.state.metrics, app.state.sessions = coordinator, tracking, sessions
    app.state.twilio = twilio or TwilioSettings()
    if getattr(getattr(coordinator, "cfg", None), "turn_detection", None) == "semantic_vad":
        # NOTE: the end-of-turn models (~0.3 s) load while the stages do, not in the first session's turn.
        threading.Thread(target=_preload_turn_models, name="turn-models", daemon=True).start()
    return app


def _preload_turn_models() -> None:
    try:
        shared_models()
    except Exception:
        log.exception("loading the end-of-turn models failed; semantic_vad sessions will fail to start")


class VoiceServer(uvicorn.Server):
    """uvicorn's server, closing the app's open sessions with 1001 before its own shutdown.

    NOTE: uvicorn closes WebSockets with 1012 (service restart) from `connection.shutdown()`, which
    the app never sees; closing them first lets each session end its response (aborted in every stage)
    and tells clients the server is going away.
    """

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        # NOTE: `config.app` is the app as given; `loaded_app` is wrapped in uvicorn's middleware.
        gate = getattr(getattr(self.config.app, "state", None), "sessions", None)
        if isinstance(gate, SessionGate):
            await gate.close_all()
        await super().shutdown(sockets)
