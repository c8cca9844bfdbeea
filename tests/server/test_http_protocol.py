"""`GuardedH11Protocol` in a real uvicorn (in a thread of this process): the request-head deadline
closes a slow request head but never a slow streamed response nor a WebSocket after its upgrade;
`HttpLimits` validation and defaults."""

from __future__ import annotations

import asyncio
import resource
import socket
import threading
import time
from collections.abc import AsyncIterator, Iterator

import pytest
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import StreamingResponse
from starlette.routing import Route, WebSocketRoute
from starlette.websockets import WebSocket
from websockets.sync.client import connect

from voice_server.server.http import HttpLimits, bind_socket, default_backlog, default_max_connections, protocol_class

HEAD_TIMEOUT_S = 0.5


async def slow(request: Request) -> StreamingResponse:
    async def chunks() -> AsyncIterator[bytes]:
        for i in range(6):
            await asyncio.sleep(0.3)
            yield f"chunk {i}\n".encode()

    return StreamingResponse(chunks(), media_type="text/plain")


async def echo(websocket: WebSocket) -> None:
    await websocket.accept()
    async for text in websocket.iter_text():
        await websocket.send_text(text)


@pytest.fixture(scope="module")
def port() -> Iterator[int]:
    app = Starlette(routes=[Route("/slow", slow), WebSocketRoute("/ws", echo)])
    limits = HttpLimits(request_head_timeout_s=HEAD_TIMEOUT_S, keep_alive_timeout_s=5.0, max_connections=64)
    config = uvicorn.Config(app, http=protocol_class(limits), lifespan="off", log_level="warning")
    server = uvicorn.Server(config)
    sock = bind_socket("127.0.0.1", 0)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started and time.monotonic() < deadline:
        time.sleep(0.01)
    yield int(sock.getsockname()[1])
    server.should_exit = True
    thread.join(10)


def test_a_slow_streamed_response_is_not_cut(port: int) -> None:
    with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
        started = time.monotonic()
        sock.sendall(b"GET /slow HTTP/1.1\r\nHost: localhost\r\n\r\n")
        data = b""
        while not data.endswith(b"0\r\n\r\n"):  # the last chunk of a chunked body
            chunk = sock.recv(65536)
            assert chunk, f"closed after {time.monotonic() - started:.2f} s: {data!r}"
            data += chunk
    assert time.monotonic() - started > 3 * HEAD_TIMEOUT_S
    assert all(f"chunk {i}".encode() in data for i in range(6))


def test_a_websocket_is_not_closed_by_the_head_deadline(port: int) -> None:
    with connect(f"ws://127.0.0.1:{port}/ws") as ws:
        time.sleep(4 * HEAD_TIMEOUT_S)
        ws.send("still here")
        assert ws.recv(timeout=5) == "still here"


def test_a_slow_request_head_is_closed(port: int) -> None:
    with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
        started = time.monotonic()
        sock.sendall(b"GET /slow HTTP/1.1\r\n")
        assert sock.recv(65536) == b""
    assert HEAD_TIMEOUT_S * 0.8 < time.monotonic() - started < HEAD_TIMEOUT_S + 2.0


def test_the_rest_of_an_answered_request_is_bounded_too(port: int) -> None:
    # NOTE: a body the app never reads (here: 405 for POST) may keep arriving after the response;
    # without the deadline a client could trickle it forever on one descriptor.
    with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
        sock.sendall(b"POST /slow HTTP/1.1\r\nHost: localhost\r\nContent-Length: 100000\r\n\r\n")
        assert sock.recv(65536).startswith(b"HTTP/1.1 405 ")
        sock.settimeout(0.1)
        started = time.monotonic()
        is_closed = False
        while not is_closed and time.monotonic() - started < 5.0:
            try:
                sock.sendall(b"x")
                is_closed = sock.recv(65536) == b""
            except TimeoutError:
                pass
            except OSError:
                is_closed = True
    assert is_closed
    assert time.monotonic() - started < HEAD_TIMEOUT_S + 2.0


def test_bad_limits_name_the_field() -> None:
    with pytest.raises(ValueError, match="'max_connections'"):
        HttpLimits(max_connections=0)
    with pytest.raises(ValueError, match="'request_head_timeout_s'"):
        HttpLimits(request_head_timeout_s=float("inf"))
    with pytest.raises(ValueError, match="'keep_alive_timeout_s'"):
        HttpLimits(keep_alive_timeout_s=-1.0)
    with pytest.raises(ValueError, match="'backlog'"):
        HttpLimits(backlog=True)


def test_default_limits_follow_the_descriptor_limit(monkeypatch: pytest.MonkeyPatch) -> None:
    for soft, max_connections, backlog in [(256, 128, 16), (1024, 512, 64), (40000, 4096, 2048), (40, 20, 16)]:
        monkeypatch.setattr(resource, "getrlimit", lambda _, soft=soft: (soft, soft))
        assert (default_max_connections(), default_backlog()) == (max_connections, backlog)
        assert HttpLimits().max_connections == max_connections
