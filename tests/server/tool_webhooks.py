"""`ToolWebhooks`: a local HTTP server (stdlib `http.server`, a thread per request) standing in for a deployment's
tool webhook, each path a way of answering:

- `/ok`: 200 JSON `{"output": "Sunny in <city>."}` (the city from the call's arguments);
- `/text`: 200 plain text `Sunny.`;
- `/chunked`: 200 JSON in `Transfer-Encoding: chunked`;
- `/slow`: waits `slow_s` (watching for the client closing the connection meanwhile), then 200 JSON;
- `/fail`: 500;
- `/big`: 200 with a body over the server's 64 KiB cap.

Every request is recorded (`hits`): its path, JSON body, headers, arrival and, for `/slow`, when the client
closed the connection while it waited (a cancelled call closes it at once; a timed-out one too).
"""

from __future__ import annotations

import json
import select
import socket
import threading
import time
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

BIG_BYTES = 70_000


@dataclass
class Hit:
    path: str
    body: Any
    headers: dict[str, str]
    at: float
    raw: bytes = b""
    """The body's bytes as sent (what a signature covers)."""
    closed_at: float | None = None
    """`/slow`: when the client closed the connection before the reply (None: it waited for it)."""


class ToolWebhooks:
    def __init__(self, slow_s: float = 3.0) -> None:
        self.slow_s = slow_s
        self.hits: list[Hit] = []
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(self))
        self.server.daemon_threads = True
        self.thread = threading.Thread(target=self.server.serve_forever, name="tool-webhooks", daemon=True)
        self.thread.start()

    @property
    def port(self) -> int:
        return int(self.server.server_address[1])

    def url(self, path: str) -> str:
        return f"http://127.0.0.1:{self.port}{path}"

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def _handler(hooks: ToolWebhooks) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def do_POST(self) -> None:
            raw = self.rfile.read(int(self.headers.get("Content-Length", "0")))
            hit = Hit(self.path, json.loads(raw), dict(self.headers.items()), time.monotonic(), raw)
            hooks.hits.append(hit)
            if self.path == "/ok":
                self._reply(200, json.dumps({"output": f"Sunny in {json.loads(hit.body['arguments'])['city']}."}))
            elif self.path == "/text":
                self._reply(200, "Sunny.", "text/plain; charset=utf-8")
            elif self.path == "/chunked":
                self._chunked(json.dumps({"output": "Sunny in chunks."}).encode())
            elif self.path == "/slow":
                if self._wait_open(hooks.slow_s):
                    self._reply(200, json.dumps({"output": "Too late."}))
                else:
                    hit.closed_at = time.monotonic()
            elif self.path == "/fail":
                self._reply(500, "boom", "text/plain")
            elif self.path == "/big":
                self._reply(200, "x" * BIG_BYTES, "text/plain")
            else:
                self._reply(404, "no such tool", "text/plain")

        def _reply(self, status: int, body: str, content_type: str = "application/json") -> None:
            data = body.encode()
            self.send_response(status)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(data)))
            self.send_header("Connection", "close")
            self.end_headers()
            self.wfile.write(data)

        def _chunked(self, data: bytes) -> None:
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Transfer-Encoding", "chunked")
            self.send_header("Connection", "close")
            self.end_headers()
            for i in range(0, len(data), 7):
                piece = data[i:i + 7]
                self.wfile.write(f"{len(piece):x}\r\n".encode() + piece + b"\r\n")
            self.wfile.write(b"0\r\n\r\n")

        def _wait_open(self, seconds: float) -> bool:
            """Wait `seconds`; False as soon as the client closes the connection (it sends nothing more)."""
            deadline = time.monotonic() + seconds
            while time.monotonic() < deadline:
                readable, _, _ = select.select([self.connection], [], [], 0.01)
                try:
                    if readable and not self.connection.recv(1, socket.MSG_PEEK):
                        return False
                except OSError:  # NOTE: reset: closed as well
                    return False
            return True

        def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 (the base class's name)
            pass

    return Handler
