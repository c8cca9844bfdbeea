"""What a WebSocket endpoint needs from the server it runs in, as Protocols: admission, the admitted
connection's guarded receive/send/close, and its metrics.

NOTE: the dependency is one-way: the server (`voice_server/server/`) imports the endpoints to route to
them, and the endpoints never import the server. They reach the server's objects through the app's
state (`websocket.app.state.sessions`, `.metrics`, `.coordinator`) and see them only as these Protocols.
The server's classes that implement them: `SessionGate` and `SessionGuard`
(`voice_server/server/sessions.py`), `Metrics` and `ConnectionMetrics` (`voice_server/server/metrics.py`);
`create_app` (`voice_server/server/app.py`) types them as these Protocols, so mypy checks that they conform.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

from starlette.websockets import WebSocket

from voice_server.config import PipelineConfig
from voice_server.engine.requests import RequestStream
from voice_server.session.events import SessionEvent

if TYPE_CHECKING:
    from voice_server.session.core import Session

__all__ = ["AdmissionLimits", "ConnectionGuard", "ConnectionTracker", "Engine", "MetricsSource", "SessionAdmission"]


class Engine(Protocol):
    """What a session needs of the engine (`Coordinator`, `voice_server/engine/coordinator.py`): its
    pipeline's config and `submit`."""

    cfg: PipelineConfig

    def submit(
        self, payload: dict[str, Any], params: dict[str, Any] | None = None, request_id: str | None = None,
        timeout_s: float | None = None, stream_input: bool = False,
    ) -> RequestStream:
        """Send a request to the entry stage; iterate the result for its terminal outputs."""
        ...


class ConnectionGuard(Protocol):
    """One admitted session's connection: receive with the idle timeout, sends with the send timeout."""

    async def receive(self) -> dict[str, Any]:
        """The next ASGI message; a `websocket.disconnect` once the connection ended (idle timeout included)."""
        ...

    async def send_text(self, text: str) -> bool:
        """False once the connection is gone (a send past the send timeout drops it)."""
        ...

    async def send_bytes(self, data: bytes) -> bool:
        """False once the connection is gone (a send past the send timeout drops it)."""
        ...

    async def close(self, code: int, reason: str, label: str) -> None:
        """Close with `code` and `reason`, counted as a session dropped for `label`."""
        ...

    async def release(self) -> None:
        """The endpoint is done with the session (call once, in a `finally`)."""
        ...


class AdmissionLimits(Protocol):
    @property
    def auth_token(self) -> str | None:
        """The server's bearer token (None: no auth); Twilio's endpoint checks it in its `start` message."""
        ...


class SessionAdmission(Protocol):
    """`app.state.sessions`: admits a WebSocket session or refuses it (closed and counted by reason)."""

    @property
    def limits(self) -> AdmissionLimits: ...

    async def admit(
        self, websocket: WebSocket, endpoint: str, subprotocol: str | None = None, is_bearer_auth: bool = True,
    ) -> ConnectionGuard | None:
        """Accept the handshake; None after closing it when the session is refused.

        `is_bearer_auth=False`: the endpoint authenticates in its own protocol (Twilio)."""
        ...


class ConnectionTracker(Protocol):
    """One connection's metrics (the calls an endpoint makes: `voice_server/server/metrics.py`'s docstring)."""

    def turn_ended(self) -> None:
        """A turn ended by a client message (typed text, manual commit, explicit response request)."""
        ...

    def protocol_error(self, code: str) -> None:
        """A client error answered without a `SessionError` event."""
        ...

    def count_session(self, session: Session) -> None:
        """Count the barge-ins and speculative responses `session` made since the last call."""
        ...

    def observe(self, event: SessionEvent) -> None:
        """Every event sent to the client, after the send."""
        ...


class MetricsSource(Protocol):
    """`app.state.metrics`: a tracker per connection."""

    def track(self, endpoint: str) -> ConnectionTracker: ...
