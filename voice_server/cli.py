"""`voice-server` command line: the flags of `serve`, `ask` and `check-config`, and `main`, which dispatches.

What each command does is in `voice_server/cli_commands.py`.

NOTE: only the standard library at import: a Ctrl-C lands in the imports while they run (the config
package takes ~0.1 s, the server ~1 s), and only `main` can turn it into a quiet exit.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

from voice_server.cli_commands import ask, check_config, serve

EXIT_INTERRUPTED = 130
"""Ctrl-C before a command took SIGINT over (the shells' 128 + SIGINT); `serve` exits 0 on it, as on any stop."""

AUTH_TOKEN_ENV = "VOICE_SERVER_AUTH_TOKEN"


def read_auth_token(path: str | None) -> str | None:
    """The token from `--auth-token-file` (first line), else from $VOICE_SERVER_AUTH_TOKEN, else None.

    NOTE: never a flag value: a command line is readable by every user of the host (/proc/PID/cmdline).
    """
    if path is not None:
        try:
            with open(path, encoding="utf-8") as f:
                return f.readline().strip()
        except (OSError, UnicodeDecodeError) as exc:
            raise ValueError(f"--auth-token-file: cannot read {path}: {exc}") from exc
    return os.environ.get(AUTH_TOKEN_ENV) or None


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be an integer >= 1, got {text}")
    return value


def _positive_float(text: str) -> float:
    value = float(text)
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"must be a number > 0, got {text}")
    return value


def _seconds_or_off(text: str) -> float:
    """A number of seconds > 0, or 0 for off (returned as 0.0)."""
    value = float(text)
    if not 0 <= value < float("inf"):
        raise argparse.ArgumentTypeError(f"must be a number >= 0 (0: off), got {text}")
    return value


def _add_session_flags(p_serve: argparse.ArgumentParser) -> None:
    p_serve.add_argument(
        "--auth-token-file", default=None, metavar="FILE",
        help=f"require this bearer token (the file's first line; else ${AUTH_TOKEN_ENV} if set) on every WebSocket "
        "session: header 'Authorization: Bearer TOKEN' or subprotocol 'openai-insecure-api-key.TOKEN' (default: none)",
    )
    p_serve.add_argument(
        "--allowed-origin", action="append", default=None, metavar="ORIGIN",
        help="a browser origin (scheme://host[:port]) allowed to open sessions; repeat for several; a handshake "
        "without Origin is always allowed (default: any origin)",
    )
    p_serve.add_argument(
        "--max-sessions", type=_positive_int, default=None,
        help="WebSocket sessions open at once; one more is closed with 1013 (default: no limit but --max-connections)",
    )
    p_serve.add_argument(
        "--max-message-bytes", type=_positive_int, default=None,
        help="largest WebSocket message a client may send; larger closes with 1009 (default: 1048576)",
    )
    p_serve.add_argument(
        "--idle-timeout", type=_seconds_or_off, default=None, metavar="SECONDS",
        help="close a session (1000) that sent nothing for this long; 0: never (default: 300)",
    )
    p_serve.add_argument(
        "--send-timeout", type=_positive_float, default=None, metavar="SECONDS",
        help="drop a client that reads nothing for this long while the server has data for it (default: 10)",
    )


def _session_limits(args: argparse.Namespace) -> dict[str, Any]:
    """`SessionLimits` fields of the flags given (absent flags keep the defaults)."""
    given = {
        "auth_token": read_auth_token(args.auth_token_file),
        "allowed_origins": tuple(args.allowed_origin) if args.allowed_origin else None,
        "max_sessions": args.max_sessions, "max_message_bytes": args.max_message_bytes,
        "idle_timeout_s": args.idle_timeout, "send_timeout_s": args.send_timeout,
    }
    sessions = {k: v for k, v in given.items() if v is not None}
    if args.idle_timeout == 0:
        sessions["idle_timeout_s"] = None  # NOTE: 0 on the command line is off
    return sessions


def main(argv: list[str] | None = None) -> int:
    try:
        return _main(argv)
    except KeyboardInterrupt:  # NOTE: Ctrl-C outside `serve` (which exits 0 on it): quiet, no traceback
        return EXIT_INTERRUPTED


def _main(argv: list[str] | None) -> int:
    parser = argparse.ArgumentParser(prog="voice-server")
    sub = parser.add_subparsers(dest="command", required=True)
    p_serve = sub.add_parser("serve", help="launch the pipeline's stage processes and the HTTP/WebSocket server")
    p_serve.add_argument("--config", default="configs/default.yaml")
    p_serve.add_argument("--host", default="127.0.0.1")
    p_serve.add_argument("--port", type=int, default=8000)
    p_serve.add_argument(
        "--log-level", default="info", type=str.lower,
        choices=["critical", "error", "warning", "info", "debug", "trace"],
    )
    p_serve.add_argument(
        "--max-connections", type=_positive_int, default=None,
        help="open client connections (HTTP and WebSocket) before new ones get 503 and are closed at once "
        "(default: half the descriptor limit, at most 4096)",
    )
    p_serve.add_argument(
        "--request-head-timeout", type=_positive_float, default=None, metavar="SECONDS",
        help="close a connection that has not sent a complete request head in this time (default: 5)",
    )
    p_serve.add_argument(
        "--keep-alive-timeout", type=_positive_float, default=None, metavar="SECONDS",
        help="close an idle keep-alive connection this long after its last response (default: 5)",
    )
    p_serve.add_argument(
        "--backlog", type=_positive_int, default=None,
        help="TCP listen backlog (default: a sixteenth of the descriptor limit, at most 2048)",
    )
    _add_session_flags(p_serve)
    p_serve.add_argument(
        "--web-dir", default=None, metavar="DIR",
        help="serve the browser demo at / from this folder (default: the repository's web/; missing: / answers 404)",
    )
    p_ask = sub.add_parser("ask", help="start a text pipeline, ask one question, stream the reply, stop")
    p_ask.add_argument("question")
    p_ask.add_argument("--config", default="configs/llm-cpu.yaml")
    p_ask.add_argument("--system", default=None, help="system prompt")
    p_ask.add_argument("--max-tokens", type=_positive_int, default=None)
    p_ask.add_argument("--log-level", default="warning", type=str.lower,
                       choices=["critical", "error", "warning", "info", "debug"])
    p_check = sub.add_parser("check-config", help="validate a pipeline and print its topology and memory budget")
    p_check.add_argument("config")
    p_check.add_argument("--traceback", action="store_true", help="show the traceback of an unexpected failure")
    p_check.add_argument("--skip-device-check", action="store_true",
                         help="do not require the config's cuda:N devices on this host (check a GPU config elsewhere)")
    args = parser.parse_args(argv)
    if args.command == "serve":
        limits = {
            "max_connections": args.max_connections, "request_head_timeout_s": args.request_head_timeout,
            "keep_alive_timeout_s": args.keep_alive_timeout, "backlog": args.backlog,
        }
        try:
            sessions = _session_limits(args)
        except ValueError as exc:
            print(f"config error: {exc}", file=sys.stderr)
            return 2
        return serve(args.config, args.host, args.port, args.log_level, limits, sessions, args.web_dir)
    if args.command == "ask":
        return ask(args.config, args.question, args.system, args.max_tokens, args.log_level)
    return check_config(args.config, show_traceback=args.traceback, is_device_check=not args.skip_device_check)


if __name__ == "__main__":
    sys.exit(main())
