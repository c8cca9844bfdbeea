"""The limits and checks every WebSocket session endpoint applies: `SessionLimits` (set by `serve`
flags, held by the app's `SessionGate`), bearer-token auth and the `Origin` allow-list.

Close codes (RFC 6455) the endpoints use: 1008 policy (auth, origin, bad first message), 1013 try
again later (the pipeline is not ready, or `max_sessions` are open), 1001 going away (the server
shuts down), 1000 normal (idle timeout), 1009 too big (uvicorn, over `max_message_bytes`).
"""

from __future__ import annotations

import hmac
import re
from dataclasses import dataclass

from starlette.websockets import WebSocket

CLOSE_NORMAL = 1000
CLOSE_GOING_AWAY = 1001
CLOSE_POLICY = 1008
CLOSE_TRY_AGAIN_LATER = 1013
SUBPROTOCOL_KEY_PREFIX = "openai-insecure-api-key."
"""How browsers pass a key (they cannot set an `Authorization` header on a WebSocket): a subprotocol."""
_TOKEN_RE = re.compile(r"^[A-Za-z0-9._~+/=-]{8,512}$")
"""Characters allowed in a bearer token (RFC 6750 `b64token`) that are also valid in a subprotocol."""
_ORIGIN_RE = re.compile(r"^(https?)://[^/\s]+$|^null$", re.IGNORECASE)


@dataclass(frozen=True)
class SessionLimits:
    auth_token: str | None = None
    """Bearer token every WebSocket session must present (`Authorization: Bearer <token>`, or the
    subprotocol `openai-insecure-api-key.<token>`); None: no auth."""
    allowed_origins: tuple[str, ...] = ()
    """Browser origins allowed to open sessions (`scheme://host[:port]`); empty: any. A handshake
    without an `Origin` header (a non-browser client) is always allowed."""
    max_sessions: int | None = None
    """Sessions open at once over all endpoints; one more is closed with 1013. None: only
    `--max-connections` bounds them."""
    max_message_bytes: int = 1 << 20
    """Largest WebSocket message a client may send (uvicorn's `ws_max_size`); a larger one closes 1009."""
    idle_timeout_s: float | None = 300.0
    """A session with no message from its client for this long is closed with 1000; None: never."""
    send_timeout_s: float = 10.0
    """A send to a client that stopped reading (its buffers full) that waits longer than this drops
    the connection, so an unread client cannot grow the server's memory."""

    def __post_init__(self) -> None:
        if self.auth_token is not None and (not isinstance(self.auth_token, str) or not _TOKEN_RE.match(
                self.auth_token)):
            raise ValueError("auth_token: must be 8-512 characters of A-Z a-z 0-9 . _ ~ + / = -")
        if not isinstance(self.allowed_origins, tuple) or not all(
                isinstance(o, str) and _ORIGIN_RE.match(o) for o in self.allowed_origins):
            raise ValueError(f"allowed_origins: each must be scheme://host[:port] (http or https), "
                             f"got {self.allowed_origins!r}")
        if self.max_sessions is not None and (isinstance(self.max_sessions, bool) or not isinstance(
                self.max_sessions, int) or self.max_sessions < 1):
            raise ValueError(f"max_sessions: must be an integer >= 1 or None, got {self.max_sessions!r}")
        if isinstance(self.max_message_bytes, bool) or not isinstance(self.max_message_bytes, int) or not (
                1024 <= self.max_message_bytes <= 1 << 30):
            raise ValueError(f"max_message_bytes: must be an integer in [1024, 2**30], got {self.max_message_bytes!r}")
        for name in ("idle_timeout_s", "send_timeout_s"):
            value = getattr(self, name)
            if value is None and name == "idle_timeout_s":
                continue
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < float("inf"):
                raise ValueError(f"{name}: must be a number of seconds > 0, got {value!r}")

    def origins(self) -> frozenset[str]:
        return frozenset(_normal_origin(o) for o in self.allowed_origins)


def _normal_origin(origin: str) -> str:
    return origin.strip().rstrip("/").lower()


def offered_key(websocket: WebSocket) -> str | None:
    """The token of an `openai-insecure-api-key.<token>` subprotocol the client offered, if any."""
    for protocol in websocket.scope.get("subprotocols", ()):
        if isinstance(protocol, str) and protocol.startswith(SUBPROTOCOL_KEY_PREFIX):
            return protocol[len(SUBPROTOCOL_KEY_PREFIX):]
    return None


def check_websocket_auth(websocket: WebSocket, token: str | None) -> bool:
    """True when `token` is None or the handshake carries it (a bearer header or the key subprotocol).

    NOTE: compared in constant time, so response timing says nothing about how much of a guess matched.
    """
    if token is None:
        return True
    expected = token.encode()
    header = websocket.headers.get("authorization", "")
    scheme, _, value = header.partition(" ")
    if scheme.lower() == "bearer" and hmac.compare_digest(value.strip().encode(), expected):
        return True
    key = offered_key(websocket)
    return key is not None and hmac.compare_digest(key.encode(), expected)


def check_origin(websocket: WebSocket, allowed: frozenset[str]) -> bool:
    """True when no allow-list is set, the handshake has no `Origin` (not a browser), or it is listed.

    NOTE: browsers always send `Origin` on a WebSocket handshake and scripts cannot forge it; the check
    stops other sites' pages from using a visitor's network position (a server on localhost or an
    intranet) to open sessions. Non-browser clients can send anything, which is what auth is for.
    """
    origin = websocket.headers.get("origin")
    return not allowed or origin is None or _normal_origin(origin) in allowed
