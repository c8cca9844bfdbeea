"""The tool webhook's HTTP client (`voice_server/session/twilio/webhook.py`) against a local HTTP server
(`tool_webhooks.py`): the contract's body, the replies it takes (JSON `output`, plain text, chunked) and the
ones it refuses (a status not 2xx, a body over the cap, no answer in time, nobody listening)."""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import json
import time
from collections.abc import Iterator

import pytest
from serving import free_port
from tool_webhooks import ToolWebhooks

from voice_server.config.errors import ConfigError
from voice_server.session.twilio.webhook import (
    MAX_REPLY_BYTES,
    ToolWebhook,
    WebhookError,
    post_call,
    reply_output,
    sign,
)

BODY = {"call_id": "call_1", "name": "get_weather", "arguments": json.dumps({"city": "Oslo"}), "call_sid": "CA1",
        "stream_sid": "MZ1"}


@pytest.fixture(scope="module")
def hooks() -> Iterator[ToolWebhooks]:
    hooks = ToolWebhooks(slow_s=2.0)
    yield hooks
    hooks.close()


def post(url: str, timeout_s: float = 2.0) -> str:
    return asyncio.run(post_call(ToolWebhook(url, timeout_s, "Sorry."), BODY))


@pytest.mark.parametrize(("path", "output"), [("/ok", "Sunny in Oslo."), ("/text", "Sunny."),
                                              ("/chunked", "Sunny in chunks.")])
def test_a_2xx_reply_is_the_calls_output(hooks: ToolWebhooks, path: str, output: str) -> None:
    assert post(hooks.url(path)) == output
    hit = hooks.hits[-1]
    assert hit.body == BODY and hit.path == path
    assert hit.headers["Content-Type"] == "application/json" and hit.headers["Host"] == f"127.0.0.1:{hooks.port}"


def test_a_secret_signs_each_request_and_none_signs_nothing(hooks: ToolWebhooks) -> None:
    before = int(time.time())
    assert asyncio.run(post_call(ToolWebhook(hooks.url("/ok"), 2.0, "Sorry.", "k3y"), BODY)) == "Sunny in Oslo."
    hit = hooks.hits[-1]
    timestamp = int(hit.headers["X-Voice-Server-Timestamp"])
    assert before <= timestamp <= time.time() + 1
    # NOTE: recomputed here as a webhook would, from the raw body it received.
    expected = hmac.new(b"k3y", f"{timestamp}.".encode() + hit.raw, hashlib.sha256).hexdigest()
    assert hit.headers["X-Voice-Server-Signature"] == f"v1={expected}"
    assert sign("other", timestamp, hit.raw) != hit.headers["X-Voice-Server-Signature"]
    post(hooks.url("/ok"))
    assert not {"X-Voice-Server-Timestamp", "X-Voice-Server-Signature"} & set(hooks.hits[-1].headers)


@pytest.mark.parametrize(("path", "reason"), [("/fail", "HTTP status 500"), ("/nope", "HTTP status 404"),
                                              ("/big", f"a reply over {MAX_REPLY_BYTES} bytes")])
def test_a_reply_that_is_not_an_output_is_an_error(hooks: ToolWebhooks, path: str, reason: str) -> None:
    with pytest.raises(WebhookError) as info:
        post(hooks.url(path))
    assert (info.value.reason, info.value.kind) == (reason, "tool_webhook_failed")


def test_no_answer_in_time_is_a_timeout_and_the_connection_is_closed(hooks: ToolWebhooks) -> None:
    started = time.monotonic()
    with pytest.raises(WebhookError) as info:
        post(hooks.url("/slow"), timeout_s=0.3)
    assert (info.value.reason, info.value.kind) == ("no answer within 0.3 s", "tool_webhook_timeout")
    assert time.monotonic() - started < 1.0
    hit = hooks.hits[-1]
    deadline = time.monotonic() + 2
    while hit.closed_at is None and time.monotonic() < deadline:
        time.sleep(0.01)
    assert hit.closed_at is not None and hit.closed_at - hit.at < 0.6, "the webhook's connection was left open"


def test_nobody_listening_is_an_error() -> None:
    with pytest.raises(WebhookError) as info:
        post(f"http://127.0.0.1:{free_port()}/x")
    assert info.value.reason.startswith("the request failed: ConnectionRefusedError")


@pytest.mark.parametrize(("body", "output"), [
    (b'{"output": "Sunny."}', "Sunny."),
    (b'{"output": {"temp_c": 21}}', '{"temp_c": 21}'),
    (b'{"temp_c": 21}', '{"temp_c": 21}'),
    (b"[" * 100_000 + b"]" * 100_000, "[" * 100_000 + "]" * 100_000),  # NOTE: RecursionError in json.loads
    (b"caf\xc3\xa9 \xff", "caf\u00e9 \ufffd"),
    (b"", ""),
])
def test_reply_output(body: bytes, output: str) -> None:
    assert reply_output(body) == output


@pytest.mark.parametrize(("url", "timeout_s", "fallback", "field"), [
    ("ftp://x.example/", 1.0, "Sorry.", "tool_webhook"),
    ("https://x.example/", 0.0, "Sorry.", "tool_timeout_s"),
    ("https://x.example/", 1.0, "", "tool_fallback"),
])
def test_a_webhook_is_checked_naming_the_field(url: str, timeout_s: float, fallback: str, field: str) -> None:
    with pytest.raises(ConfigError, match=f"field '{field}'"):
        ToolWebhook(url, timeout_s, fallback)
