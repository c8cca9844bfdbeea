"""A call's tool webhook: one HTTP POST per tool call the model makes, on the server's event loop.

The contract (docs/PROTOCOLS.md, "WS /twilio/media"): the request is `POST <url>` with the JSON body
`{"call_id", "name", "arguments" (the arguments object as JSON text), "call_sid", "stream_sid"}`; a 2xx
reply is the call's output: JSON `{"output": "..."}` (a non-string `output` is kept as its JSON text), else
the body as text (UTF-8). Anything else is a `WebhookError`: no reply within `timeout_s` (connecting
included), a connection that fails, a status that is not 2xx (redirects are not followed: the URL was
checked, where it points to was not), a body over `MAX_REPLY_BYTES`, a reply that is not HTTP.

With a secret (`twilio.tool_webhook_secret_env`) each request is signed: `X-Voice-Server-Timestamp` (Unix
seconds) and `X-Voice-Server-Signature: v1=<hex HMAC-SHA256 of "{timestamp}.{body}">` (`sign`), so the webhook
can refuse requests that are not this server's (anyone may POST to a public URL) and stale ones (replays).

NOTE: asyncio streams and `h11` (the HTTP/1.1 state machine uvicorn itself depends on), not urllib in a
thread: a cancelled call (the caller hung up) closes its connection at once, a slow webhook holds no
thread (the default executor has a handful), and the timeout covers the whole exchange.
"""

from __future__ import annotations

import asyncio
import functools
import hashlib
import hmac
import json
import ssl
import time
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

import h11

from voice_server.config.errors import fail
from voice_server.config.twilio import TOOL_RULES

__all__ = ["MAX_REPLY_BYTES", "SIGNATURE_HEADER", "TIMESTAMP_HEADER", "ToolWebhook", "WebhookError", "post_call",
           "reply_output", "sign"]

MAX_REPLY_BYTES = 64 << 10
"""A tool's output goes into every later prompt of the call: a larger reply is a webhook's bug."""
_READ_BYTES = 16 << 10
TIMESTAMP_HEADER = "X-Voice-Server-Timestamp"
SIGNATURE_HEADER = "X-Voice-Server-Signature"
_TIMEOUT = "tool_webhook_timeout"
_FAILED = "tool_webhook_failed"


@dataclass(frozen=True)
class ToolWebhook:
    """Where one call's tool calls go, how long each may take, and what the agent says when one fails."""

    url: str
    timeout_s: float
    fallback: str
    secret: str = field(default="", repr=False)
    """Signs each request (`sign`); "" sends no signature."""

    def __post_init__(self) -> None:
        # NOTE: `TwilioConfig`'s own rules (`voice_server/config/twilio.py`), named as its fields are.
        for name, value in (("tool_webhook", self.url), ("tool_timeout_s", self.timeout_s),
                            ("tool_fallback", self.fallback)):
            problem = TOOL_RULES[name].problem(value)
            if problem is not None or not value:
                raise fail("twilio", name, problem or "must not be empty")


class WebhookError(Exception):
    """A call the webhook did not answer; `reason` says why (no arguments: they may hold the caller's data)."""

    def __init__(self, reason: str, kind: str = _FAILED) -> None:
        super().__init__(reason)
        self.reason = reason
        self.kind = kind
        """`tool_webhook_timeout` or `tool_webhook_failed`: the label it is counted under."""


@functools.cache
def _tls() -> ssl.SSLContext:
    return ssl.create_default_context()


async def post_call(webhook: ToolWebhook, body: dict[str, Any]) -> str:
    """POST `body` (JSON) to the webhook; the call's output, or WebhookError."""
    try:
        async with asyncio.timeout(webhook.timeout_s):
            data = json.dumps(body, ensure_ascii=False).encode()
            status, reply = await _post(webhook.url, data, _signature_headers(webhook.secret, data))
    except TimeoutError as exc:
        raise WebhookError(f"no answer within {webhook.timeout_s:g} s", _TIMEOUT) from exc
    except (OSError, h11.ProtocolError, UnicodeError, ValueError) as exc:
        # NOTE: OSError: refused, reset, DNS (gaierror), TLS (SSLError); UnicodeError: a host IDNA cannot encode.
        raise WebhookError(f"the request failed: {type(exc).__name__}: {exc}"[:200]) from exc
    if not 200 <= status < 300:
        raise WebhookError(f"HTTP status {status}")
    return reply_output(reply)


def sign(secret: str, timestamp: int, body: bytes) -> str:
    """`v1=` and the hex HMAC-SHA256, keyed by `secret`, of `{timestamp}.{body}`: what the webhook recomputes to
    know the request is this server's, and checks the timestamp of to refuse a replayed one."""
    digest = hmac.new(secret.encode(), f"{timestamp}.".encode() + body, hashlib.sha256).hexdigest()
    return f"v1={digest}"


def _signature_headers(secret: str, body: bytes) -> list[tuple[str, str]]:
    if not secret:
        return []
    timestamp = int(time.time())
    return [(TIMESTAMP_HEADER, str(timestamp)), (SIGNATURE_HEADER, sign(secret, timestamp, body))]


def reply_output(body: bytes) -> str:
    """A 2xx reply's body -> the call's output: `{"output": ...}`'s, else the body's text."""
    text = body.decode("utf-8", errors="replace")
    try:
        value = json.loads(text)
    except (ValueError, RecursionError):
        return text
    if isinstance(value, dict) and "output" in value:
        output = value["output"]
        return output if isinstance(output, str) else json.dumps(output, ensure_ascii=False)
    return text


async def _post(url: str, body: bytes, extra_headers: list[tuple[str, str]]) -> tuple[int, bytes]:
    parts = urlsplit(url)
    is_tls = parts.scheme == "https"
    host = parts.hostname or ""
    reader, writer = await asyncio.open_connection(
        host, parts.port or (443 if is_tls else 80), ssl=_tls() if is_tls else None,
        server_hostname=host if is_tls else None)
    try:
        conn = h11.Connection(h11.CLIENT, max_incomplete_event_size=_READ_BYTES)
        target = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
        headers = [("Host", parts.netloc), ("Content-Type", "application/json"), ("Content-Length", str(len(body))),
                   ("Accept", "application/json, text/plain"), ("User-Agent", "voice-server"), ("Connection", "close"),
                   *extra_headers]
        writer.write(conn.send(h11.Request(method="POST", target=target, headers=headers)) or b"")
        writer.write(conn.send(h11.Data(data=body)) or b"")
        writer.write(conn.send(h11.EndOfMessage()) or b"")
        await writer.drain()
        return await _read_reply(conn, reader)
    finally:
        # NOTE: not awaited: a TLS close can wait on the peer, and a cancelled call must end now.
        writer.close()


async def _read_reply(conn: h11.Connection, reader: asyncio.StreamReader) -> tuple[int, bytes]:
    status, chunks, size = 0, [], 0
    while True:
        event = conn.next_event()
        if event is h11.NEED_DATA:
            conn.receive_data(await reader.read(_READ_BYTES))
        elif isinstance(event, h11.Response):
            status = event.status_code
        elif isinstance(event, h11.Data):
            size += len(event.data)
            if size > MAX_REPLY_BYTES:
                raise WebhookError(f"a reply over {MAX_REPLY_BYTES} bytes")
            chunks.append(bytes(event.data))
        elif isinstance(event, h11.EndOfMessage | h11.ConnectionClosed):
            if status == 0:
                raise WebhookError("the connection closed before a reply")
            return status, b"".join(chunks)
