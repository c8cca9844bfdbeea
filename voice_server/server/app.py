"""The HTTP/WebSocket front: a starlette app whose lifespan owns the coordinator.

Routes so far: `GET /health` (200 only when every stage process is ready). The WebSocket
session layer (`/v1/realtime`, `/twilio/media`, `/ws`) arrives with the session issue.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from voice_server.config import PipelineConfig
from voice_server.engine.coordinator import Coordinator


async def health(request: Request) -> JSONResponse:
    coordinator: Coordinator | None = getattr(request.app.state, "coordinator", None)
    if coordinator is None:
        return JSONResponse({"status": "starting", "stages": {}}, status_code=503)
    body = coordinator.health()
    return JSONResponse(body, status_code=200 if coordinator.is_ready else 503)


def create_app(cfg: PipelineConfig) -> Starlette:
    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        coordinator = Coordinator(cfg)
        # NOTE: stages start before the port opens: a failed load stops `serve` with its error
        # instead of leaving a server that can only answer 503.
        await coordinator.start()
        app.state.coordinator = coordinator
        try:
            yield
        finally:
            await coordinator.stop()

    return Starlette(routes=[Route("/health", health)], lifespan=lifespan)
