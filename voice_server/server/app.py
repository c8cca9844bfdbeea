"""The HTTP/WebSocket front: a starlette app over a started coordinator.

`serve` (`voice_server/server/runner.py`) owns the coordinator: it starts the stages before the
port listens and stops them after the server has closed its connections, so a stop signal is
handled at any point instead of after start-up.

Routes: `GET /health` (200 only when every stage process is ready), `WS /ws`, the native voice
protocol (`voice_server/session/native.py`), `WS /v1/realtime`, the OpenAI Realtime protocol
(`voice_server/session/realtime/endpoint.py`), and `WS /twilio/media`, phone calls over Twilio Media
Streams (`voice_server/session/twilio/endpoint.py`; its settings, e.g. the token, in
`app.state.twilio`).
"""

from __future__ import annotations

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route, WebSocketRoute

from voice_server.engine.coordinator import Coordinator
from voice_server.session.native import native_ws
from voice_server.session.realtime.endpoint import realtime_ws
from voice_server.session.twilio.endpoint import TwilioSettings, twilio_ws


async def health(request: Request) -> JSONResponse:
    coordinator: Coordinator = request.app.state.coordinator
    return JSONResponse(coordinator.health(), status_code=200 if coordinator.is_ready else 503)


def create_app(coordinator: Coordinator, twilio: TwilioSettings | None = None) -> Starlette:
    app = Starlette(routes=[Route("/health", health), WebSocketRoute("/ws", native_ws),
                            WebSocketRoute("/v1/realtime", realtime_ws), WebSocketRoute("/twilio/media", twilio_ws)])
    app.state.coordinator = coordinator
    app.state.twilio = twilio or TwilioSettings()
    return app
