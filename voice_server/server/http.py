"""HTTP connection hygiene: the limits `serve` enforces on client connections, and the uvicorn
protocol that enforces them.

uvicorn (h11) closes an idle keep-alive connection only after a response, and never times out a
connection that has not yet sent a complete request: a slowloris client (headers one byte at a
time) or a connection that sends nothing holds a descriptor forever. `GuardedH11Protocol` adds:

- a request-head deadline, armed when a connection opens and when the first byte of a later
  request arrives, cancelled once a complete request head has been parsed: a connection that has
  not delivered one in `request_head_timeout_s` is closed (slowloris, silent connections). It never
  fires while the app is answering (slow streamed responses) nor after a WebSocket upgrade.
- a cap on open connections (HTTP and WebSocket, as uvicorn counts them): a connection beyond
  `max_connections` gets a 503 and is closed at once, so descriptors stay free for the engine
  (ZMQ sockets, relay segments) and for the connections already open.
"""

from __future__ import annotations

import asyncio
import logging
import resource
import socket
from dataclasses import dataclass, field
from typing import Any, ClassVar

from uvicorn.config import Config
from uvicorn.protocols.http.h11_impl import H11Protocol
from uvicorn.server import ServerState

log = logging.getLogger("voice_server.http")

_MAX_DEFAULT_CONNECTIONS = 4096
_MAX_DEFAULT_BACKLOG = 2048
_MIN_DEFAULT = 16
_NOFILE_TARGET_IF_UNLIMITED = 65536
_REFUSED_BODY = b"too many open connections\n"
_REFUSED_RESPONSE = (
    b"HTTP/1.1 503 Service Unavailable\r\ncontent-type: text/plain; charset=utf-8\r\nconnection: close\r\n"
    b"content-length: " + str(len(_REFUSED_BODY)).encode() + b"\r\n\r\n" + _REFUSED_BODY
)


def raise_nofile_limit() -> int:
    """Raise the soft descriptor limit to the hard one (common server practice); return the soft limit.

    NOTE: the soft limit is often 1,024 while the hard one is far higher; one descriptor per client
    connection plus the engine's sockets and segments can use the difference. Stage processes
    inherit the raised limit.
    """
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = hard if hard != resource.RLIM_INFINITY else max(soft, _NOFILE_TARGET_IF_UNLIMITED)
    if soft != resource.RLIM_INFINITY and target > soft:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (ValueError, OSError) as exc:
            log.warning("cannot raise the descriptor limit from %d to %d: %s", soft, target, exc)
    return soft


def _soft_nofile() -> int | None:
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    return None if soft == resource.RLIM_INFINITY else soft


def default_max_connections() -> int:
    """Half the soft descriptor limit, within [16, 4096]."""
    soft = _soft_nofile()
    return _MAX_DEFAULT_CONNECTIONS if soft is None else max(_MIN_DEFAULT, min(_MAX_DEFAULT_CONNECTIONS, soft // 2))


def default_backlog() -> int:
    """A sixteenth of the soft descriptor limit, within [16, 2048]."""
    soft = _soft_nofile()
    return _MAX_DEFAULT_BACKLOG if soft is None else max(_MIN_DEFAULT, min(_MAX_DEFAULT_BACKLOG, soft // 16))


@dataclass(frozen=True)
class HttpLimits:
    max_connections: int = field(default_factory=default_max_connections)
    """Open client connections (HTTP and WebSocket); one more is answered 503 and closed at once."""
    request_head_timeout_s: float = 5.0
    """A connection must deliver a complete request head within this time of opening (or of the
    first byte of a later request on a keep-alive connection)."""
    keep_alive_timeout_s: float = 5.0
    """An idle keep-alive connection is closed this long after its last response."""
    backlog: int = field(default_factory=default_backlog)
    """Pending TCP connections the kernel queues (Linux caps it at net.core.somaxconn).

    NOTE: asyncio accepts up to `backlog` connections per loop turn, and a refused one's descriptor is
    freed only a turn or two later (`connection_made` runs on the next turn, the close on the one
    after), so under a flood descriptors peak at about engine + max_connections + 3 x backlog: the
    defaults (1/2 and 1/16 of the soft limit) leave 5/16 of it to the engine, and a flood never hits
    EMFILE. With 1/8, 35 + 128 + 3 x 32 = 259 of 256 did, now and then."""
    shutdown_grace_s: int = 1
    """On a stop signal, requests and WebSockets in flight get this long (whole seconds, uvicorn's
    `timeout_graceful_shutdown`) before they are cancelled."""

    def __post_init__(self) -> None:
        for name in ("max_connections", "backlog"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"http limit '{name}' must be an integer >= 1, got {value!r}")
        for name in ("request_head_timeout_s", "keep_alive_timeout_s"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < float("inf"):
                raise ValueError(f"http limit '{name}' must be a number of seconds > 0, got {value!r}")
        value = self.shutdown_grace_s
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ValueError(f"http limit 'shutdown_grace_s' must be an integer >= 0, got {value!r}")


class GuardedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol with a request-head deadline and a connection cap (`limits`)."""

    limits: ClassVar[HttpLimits]

    def __init__(
        self,
        config: Config,
        server_state: ServerState,
        app_state: dict[str, Any],
        _loop: asyncio.AbstractEventLoop | None = None,
    ) -> None:
        super().__init__(config, server_state, app_state, _loop)
        # NOTE: uvicorn types it int but only passes it to call_later, which takes float seconds.
        self.timeout_keep_alive = self.limits.keep_alive_timeout_s  # type: ignore[assignment]
        self._head_timer: asyncio.TimerHandle | None = None
        self._num_head_bytes = 0

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        if len(self.connections) > self.limits.max_connections:
            # NOTE: uvicorn's limit_concurrency answers 503 only once a request arrives; by then
            # the descriptor is already held. Refusing here keeps the count bounded.
            self.connections.discard(self)
            log.warning("refused a connection: max_connections (%d) are open", self.limits.max_connections)
            transport.write(_REFUSED_RESPONSE)
            transport.close()
            return
        self._arm_head_timer()

    def data_received(self, data: bytes) -> None:
        if self._is_awaiting_request():
            self._arm_head_timer()
            self._num_head_bytes += len(data)
        super().data_received(data)
        if not self._is_awaiting_request() or self.transport.get_protocol() is not self:
            self._cancel_head_timer()  # a request head arrived (or the connection became a WebSocket)

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_head_timer()
        super().connection_lost(exc)

    def _is_awaiting_request(self) -> bool:
        """True while no request is being answered: before a request head, between keep-alive
        requests, or while the client is still sending the body of a request already answered."""
        return self.cycle is None or self.cycle.response_complete

    def _arm_head_timer(self) -> None:
        if self._head_timer is None:
            self._num_head_bytes = 0
            self._head_timer = self.loop.call_later(self.limits.request_head_timeout_s, self._on_head_timeout)

    def _cancel_head_timer(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _on_head_timeout(self) -> None:
        self._head_timer = None
        if self.transport.is_closing() or self.transport.get_protocol() is not self:
            return
        if not self._is_awaiting_request():
            return
        if self._num_head_bytes:
            log.warning(
                "closed a connection that sent no complete request within %gs (request_head_timeout_s)",
                self.limits.request_head_timeout_s,
            )
        else:
            log.debug("closed a connection that sent nothing for %gs", self.limits.request_head_timeout_s)
        self.transport.close()  # NOTE: connection_lost tells h11 the connection closed


def protocol_class(limits: HttpLimits) -> type[GuardedH11Protocol]:
    """The protocol class to pass as uvicorn's `http=`, bound to `limits`.

    NOTE: always h11, even when httptools is installed (uvicorn's "auto" would pick it): the
    deadline hooks h11_impl's request cycle, and a voice server's traffic is WebSocket frames, not
    HTTP parsing.
    """
    return type("GuardedH11Protocol", (GuardedH11Protocol,), {"limits": limits})


def bind_socket(host: str, port: int) -> socket.socket:
    """Bind (without listening) so a port clash fails before the stages load; asyncio listens later.

    NOTE: until `listen`, connection attempts are refused, as before the server starts.
    """
    family, kind, proto, _, address = socket.getaddrinfo(
        host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
    )[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
    except OSError:
        sock.close()
        raise
    return sock
