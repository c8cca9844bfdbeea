"""The session flags of `voice-server serve` on a real process: each reaches the session gate (auth
by file and environment, origin, max sessions, message size, idle timeout) and a bad value is one
`config error` line naming the field, exit 2."""

from __future__ import annotations

import contextlib
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from websockets.exceptions import ConnectionClosed
from websockets.sync.client import ClientConnection, connect

sys.path.insert(0, str(Path(__file__).parent))
from serving import ServerProcess  # noqa: E402

ServeProcess = Callable[..., ServerProcess]
TOKEN = "file-token-123"


def start(port: int, **kwargs: Any) -> ClientConnection:
    ws = connect(f"ws://127.0.0.1:{port}/ws", open_timeout=5, **kwargs)
    with contextlib.suppress(ConnectionClosed):  # NOTE: refused before it went out; `recv` raises it again
        ws.send(json.dumps({"type": "session.start"}))
    return ws


def closed_with(ws: ClientConnection) -> tuple[int, str]:
    with pytest.raises(ConnectionClosed) as info:
        while True:
            ws.recv(5)
    assert info.value.rcvd is not None
    return info.value.rcvd.code, info.value.rcvd.reason


def test_session_flags_reach_the_gate(serve_process: ServeProcess, tmp_path: Path) -> None:
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN + "\n")
    server = serve_process("--auth-token-file", str(token_file), "--allowed-origin", "https://ok.example",
                           "--max-sessions", "1", "--max-message-bytes", "4096", "--idle-timeout", "1")
    server.wait_healthy()
    auth = {"additional_headers": {"Authorization": f"Bearer {TOKEN}"}}
    assert closed_with(start(server.port))[0] == 1008
    assert closed_with(start(server.port, origin="https://evil.example", **auth))[0] == 1008
    ws = start(server.port, origin="https://ok.example", **auth)
    assert json.loads(ws.recv(5))["type"] == "session.started"
    assert closed_with(start(server.port, **auth))[0] == 1013  # max-sessions 1
    ws.send(b"\x00" * 4098)
    assert closed_with(ws)[0] == 1009
    time.sleep(0.3)  # the slot frees once the session has ended
    ws = start(server.port, subprotocols=[f"openai-insecure-api-key.{TOKEN}"])
    assert json.loads(ws.recv(5))["type"] == "session.started"
    started = time.monotonic()
    assert closed_with(ws) == (1000, "idle timeout: no message for 1 s")
    assert time.monotonic() - started < 3
    assert server.stop() == 0


def test_the_token_can_come_from_the_environment(
    serve_process: ServeProcess, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("VOICE_SERVER_AUTH_TOKEN", TOKEN)
    server = serve_process()
    server.wait_healthy()
    assert closed_with(start(server.port)) == (1008, "missing or invalid bearer token")
    ws = start(server.port, additional_headers={"Authorization": f"Bearer {TOKEN}"})
    assert json.loads(ws.recv(5))["type"] == "session.started"
    ws.close()


@pytest.mark.parametrize("args,expected", [
    (("--allowed-origin", "evil"), "config error: allowed_origins: each must be scheme://host[:port]"),
    (("--max-message-bytes", "10"), "config error: max_message_bytes: must be an integer in [1024, 2**30]"),
    (("--idle-timeout", "-1"), "--idle-timeout: must be a number >= 0 (0: off)"),
    (("--send-timeout", "0"), "--send-timeout: must be a number > 0"),
    (("--auth-token-file", "/nonexistent/token"), "config error: --auth-token-file: cannot read"),
])
def test_bad_session_flags_are_one_line_and_exit_2(serve_process: ServeProcess, args: tuple[str, ...],
                                                   expected: str) -> None:
    server = serve_process(*args)
    assert server.proc.wait(30) == 2
    assert expected in server.stderr and "Traceback" not in server.stderr, server.stderr


def test_a_short_token_is_refused_naming_the_field(serve_process: ServeProcess, tmp_path: Path) -> None:
    token_file = tmp_path / "token"
    token_file.write_text("short\n")
    server = serve_process("--auth-token-file", str(token_file))
    assert server.proc.wait(30) == 2
    assert "config error: auth_token: must be 8-512 characters" in server.stderr
