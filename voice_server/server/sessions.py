"""`SessionGate` (`app.state.sessions`): admission of WebSocket sessions and the open sessions'
guards: auth, origin, readiness, `max_sessions`, idle timeout, slow clients, shutdown.

An endpoint uses it like this (`voice_server/session/native.py` does):

    guard = await websocket.app.state.sessions.admit(websocket, "native", subprotocol=None)
    if guard is None:
        return                       # refused: already closed with 1008 / 1013 / 1001, and counted
    try:
        message = await guard.receive()          # idle timeout -> closes 1000, returns a disconnect
        ok = await guard.send_text(text)         # or send_bytes; False once the connection is gone
    finally:
        await guard.release()

A refused session is accepted and then closed with its code and a reason: a close before `accept`
becomes an HTTP 403 that a browser cannot tell apart from any other failure.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from typing import Any

from starlette.websockets import WebSocket, WebSocketDisconnect, WebSocketState

from voice_server.server.metrics import Metrics
from voice_server.server.session_limits import (
    CLOSE_GOING_AWAY,
    CLOSE_NORMAL,
    CLOSE_POLICY,
    CLOSE_TRY_AGAIN_LATER,
    SessionLimits,
    check_origin,
    check_websocket_auth,
)

log = logging.getLogger("voice_server.sessions")

_CLOSE_WAIT_S = 1.0
"""How long a close frame may wait for room in the send buffer before the connection is dropped."""
_SEND_ERRORS = (RuntimeError, OSError, ConnectionError, WebSocketDisconnect)
"""What a send to a connection that is gone raises (starlette's WebSocketDisconnect, uvicorn's
ClientDisconnected is an OSError)."""


class SessionGate:
    def __init__(self, limits: SessionLimits, metrics: Metrics, is_ready: Callable[[], bool]) -> None:
        self.limits, self.metrics, self._is_ready = limits, metrics, is_ready
        self._origins = limits.origins()
        self.guards: set[SessionGuard] = set()
        self.is_closing = False

    async def admit(
        self, websocket: WebSocket, endpoint: str, subprotocol: str | None = None, is_bearer_auth: bool = True,
    ) -> SessionGuard | None:
        """Accept the handshake; None after closing it when the session is refused (counted by reason).

        `is_bearer_auth=False`: the endpoint authenticates in its own protocol (Twilio: a token in its
        `start` message, since Twilio sends no header of ours)."""
        refusal = self._refusal(websocket, is_bearer_auth)
        await websocket.accept(subprotocol=subprotocol)
        if refusal is not None:
            code, reason, label = refusal
            self.metrics.session_refused(endpoint, label)
            log.info("refused a %s session (%s): %s", endpoint, label, reason)
            with contextlib.suppress(*_SEND_ERRORS):
                async with asyncio.timeout(_CLOSE_WAIT_S):
                    await websocket.close(code, reason=reason)
            return None
        guard = SessionGuard(self, websocket, endpoint)
        self.guards.add(guard)
        self.metrics.session_opened(endpoint)
        return guard

    def _refusal(self, websocket: WebSocket, is_bearer_auth: bool) -> tuple[int, str, str] | None:
        if not check_origin(websocket, self._origins):
            return CLOSE_POLICY, "origin not allowed", "origin"
        if is_bearer_auth and not check_websocket_auth(websocket, self.limits.auth_token):
            return CLOSE_POLICY, "missing or invalid bearer token", "auth"
        if self.is_closing:
            return CLOSE_GOING_AWAY, "server shutting down", "shutdown"
        if not self._is_ready():
            return CLOSE_TRY_AGAIN_LATER, "the pipeline is not ready (starting or restarting); try again later", \
                "not_ready"
        if self.limits.max_sessions is not None and len(self.guards) >= self.limits.max_sessions:
            return CLOSE_TRY_AGAIN_LATER, f"server full: {self.limits.max_sessions} sessions open; try again later", \
                "full"
        return None

    async def close_all(self, code: int = CLOSE_GOING_AWAY, reason: str = "server shutting down") -> None:
        """Refuse new sessions and close the open ones (shutdown)."""
        self.is_closing = True
        guards = list(self.guards)
        if guards:
            log.info("closing %d open session(s): %s", len(guards), reason)
        await asyncio.gather(*(g.close(code, reason, label="shutdown") for g in guards))


class SessionGuard:
    """One admitted session's connection: receive with the idle timeout, sends with the send timeout; the
    endpoints see it as `ConnectionGuard` (`voice_server/session/connection.py`)."""

    def __init__(self, gate: SessionGate, websocket: WebSocket, endpoint: str) -> None:
        self.gate, self.websocket, self.endpoint = gate, websocket, endpoint
        self.is_open = True
        self.close_reason = ""
        self._is_released = False

    async def receive(self) -> dict[str, Any]:
        """The next ASGI message; a `websocket.disconnect` once the connection ended (idle timeout included)."""
        if not self.is_open:
            return {"type": "websocket.disconnect", "code": CLOSE_NORMAL}
        try:
            async with asyncio.timeout(self.gate.limits.idle_timeout_s):
                message = await self.websocket.receive()
        except TimeoutError:
            await self.close(CLOSE_NORMAL, f"idle timeout: no message for {self.gate.limits.idle_timeout_s:g} s",
                             label="idle")
            return {"type": "websocket.disconnect", "code": CLOSE_NORMAL}
        except _SEND_ERRORS:
            self.is_open = False
            return {"type": "websocket.disconnect", "code": 1006}
        if message["type"] == "websocket.disconnect":
            self.is_open = False
        return dict(message)

    async def send_text(self, text: str) -> bool:
        return await self._send({"type": "websocket.send", "text": text})

    async def send_bytes(self, data: bytes) -> bool:
        return await self._send({"type": "websocket.send", "bytes": data})

    async def _send(self, message: dict[str, Any]) -> bool:
        """False when the connection is gone; a send that waits past `send_timeout_s` drops it."""
        if not self.is_open:
            return False
        timeout_s = self.gate.limits.send_timeout_s
        try:
            # NOTE: a timeout scope, not `wait_for`: wait_for runs the send in a task of its own, and the
            # ASGI sends of one connection must stay in order in the caller's task (a send still pending
            # in its own task after a cancel could race the next one).
            async with asyncio.timeout(timeout_s):
                await self.websocket.send(message)
        except TimeoutError:
            # NOTE: a close frame would queue behind the unread data, so the connection is dropped.
            self._drop(f"client too slow: a send waited more than {timeout_s:g} s", "slow_client")
            return False
        except _SEND_ERRORS:
            self.is_open = False
            return False
        return True

    async def close(self, code: int, reason: str, label: str) -> None:
        """Close with `code` and `reason` (counted as dropped for `label`); drop the connection if the
        close frame cannot be sent within a second."""
        if not self.is_open:
            return
        self.is_open, self.close_reason = False, reason
        self.gate.metrics.session_dropped(self.endpoint, label)
        log.info("closing a %s session (%d): %s", self.endpoint, code, reason)
        if self.websocket.application_state is WebSocketState.DISCONNECTED:
            return
        try:
            async with asyncio.timeout(_CLOSE_WAIT_S):
                await self.websocket.close(code, reason=reason[:120])
        except TimeoutError:
            _abort_transport(self.websocket)
        except _SEND_ERRORS:
            pass

    def _drop(self, reason: str, label: str) -> None:
        self.is_open, self.close_reason = False, reason
        self.gate.metrics.session_dropped(self.endpoint, label)
        log.warning("dropped a %s session: %s", self.endpoint, reason)
        _abort_transport(self.websocket)

    async def release(self) -> None:
        """The endpoint is done with the session (call once, in a `finally`)."""
        if self._is_released:
            return
        self._is_released = True
        self.gate.guards.discard(self)
        self.gate.metrics.session_closed(self.endpoint)
        if self.is_open:
            self.is_open = False
            if self.websocket.application_state is not WebSocketState.DISCONNECTED:
                with contextlib.suppress(asyncio.TimeoutError, *_SEND_ERRORS):
                    async with asyncio.timeout(_CLOSE_WAIT_S):
                        await self.websocket.close(CLOSE_NORMAL)


ABORT_SCOPE_KEY = "voice_server.abort"


class AbortHandleMiddleware:
    """ASGI middleware that puts a WebSocket connection's `abort` (drop the TCP connection) into its
    scope under `ABORT_SCOPE_KEY`, for `SessionGuard` to drop a client that stopped reading.

    NOTE: ASGI has no abort, and a close waits for the send buffer to drain, which a client that stopped
    reading never lets happen (its descriptor would be held forever). uvicorn hands the app its
    protocol's bound `send`, whose owner holds the transport; further in, starlette wraps `send` in
    closures, so it is looked up here, outermost (this must be the app's first middleware).
    """

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "websocket":
            transport = getattr(getattr(send, "__self__", None), "transport", None)
            if transport is not None and hasattr(transport, "abort"):
                scope[ABORT_SCOPE_KEY] = transport.abort
        await self.app(scope, receive, send)


def _abort_transport(websocket: WebSocket) -> None:
    """Drop the TCP connection at once (unsent data discarded)."""
    abort = websocket.scope.get(ABORT_SCOPE_KEY)
    if abort is not None:
        abort()
    else:
        log.warning("cannot drop a WebSocket connection: no abort handle in its scope (AbortHandleMiddleware)")
