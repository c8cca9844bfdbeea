"""`voice-server serve`: one event loop that serves HTTP, starts the stages and stops on a signal
at any point.

Order: bind the port (a clash fails in milliseconds, before any model loads) -> listen (uvicorn) ->
start the coordinator (stage processes load; meanwhile `/health` answers 503 with each stage's
state and WebSocket sessions are closed with 1013, try again later) -> serve -> on SIGTERM/SIGINT
stop uvicorn (open sessions are closed with 1001 first), then the coordinator. A stage that fails
to start stops the HTTP server and `serve` exits 2.

The loop owns SIGTERM and SIGINT from the start: a signal while the stages load cancels the
coordinator's start (which stops what it launched: loading stages exit at once on SIGTERM) and
stops uvicorn; while serving it makes uvicorn close its connections (requests in flight get
`shutdown_grace_s`); a second signal makes uvicorn stop waiting. Exit codes: 0 after a stop signal at any point,
2 for configuration and start-up errors (one paragraph on stderr; the traceback is logged at
DEBUG), 1 for anything unexpected.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import uvicorn

from voice_server.config import PipelineConfig
from voice_server.config.errors import one_line
from voice_server.engine.coordinator import Coordinator, StartupError
from voice_server.logs import flush_rate_limits, install_rate_limit
from voice_server.server.app import VoiceServer, create_app
from voice_server.server.http import HttpLimits, bind_socket, protocol_class
from voice_server.server.session_limits import SessionLimits
from voice_server.session.twilio.settings import twilio_settings

log = logging.getLogger("voice_server.server")
EXIT_STOPPED = 0
EXIT_STARTUP_ERROR = 2
_STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)
_LOG_FLUSH_INTERVAL_S = 1.0
_LISTEN_POLL_S = 0.01
_LOG_FORMAT = "%(asctime)s %(name)s %(levelname)s %(message)s"


class ServeError(Exception):
    """A start-up failure, worded as the paragraph `serve` prints."""


@dataclass(frozen=True)
class ServeOptions:
    host: str = "127.0.0.1"
    port: int = 8000
    log_level: str = "info"
    limits: HttpLimits = field(default_factory=HttpLimits)
    sessions: SessionLimits = field(default_factory=SessionLimits)
    web_dir: Path | None = None
    """The browser demo's files (None: the repository's `web/`)."""


def configure_logging(log_level: str) -> None:
    """One root handler on stderr for everything (uvicorn's loggers included), rate-limited."""
    level = uvicorn.config.LOG_LEVELS[log_level.lower()]  # NOTE: importing uvicorn registers TRACE
    logging.basicConfig(level=level, format=_LOG_FORMAT)
    install_rate_limit()


def run_server(cfg: PipelineConfig, options: ServeOptions) -> int:
    """Serve until SIGTERM/SIGINT; return the exit code (0 stopped, 2 start-up error)."""
    try:
        return asyncio.run(_serve_until_stopped(cfg, options))
    except ServeError as exc:
        log.debug("start-up failed", exc_info=True)
        print(f"start-up error: {one_line(str(exc), max_len=2000)}", file=sys.stderr)
        return EXIT_STARTUP_ERROR
    except KeyboardInterrupt:  # NOTE: Ctrl-C before the loop took over SIGINT: nothing started yet
        return EXIT_STOPPED
    finally:
        flush_rate_limits(is_final=True)


class _Server(VoiceServer):
    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        # NOTE: the loop's handlers own SIGINT/SIGTERM for the whole run; uvicorn's would replace
        # them while it serves and re-raise the signal when it returns.
        yield

    async def shutdown(self, sockets: list[Any] | None = None) -> None:
        await super().shutdown(sockets)
        if self.force_exit and not self.lifespan.shutdown_event.is_set():
            # NOTE: uvicorn skips the lifespan's shutdown on a forced exit (a second stop signal), leaving
            # its task waiting; asyncio.run cancels it at the end and uvicorn logs that as an ERROR with a
            # CancelledError traceback. The app has no shutdown handlers: ending it is immediate.
            await self.lifespan.shutdown()


class _Stopper:
    """The loop's SIGINT/SIGTERM handler."""

    def __init__(self) -> None:
        self.signal: int | None = None
        self.start_task: asyncio.Future[None] | None = None
        self.server: _Server | None = None

    def __call__(self, signum: int) -> None:
        name = signal.Signals(signum).name
        if self.signal is not None:
            if self.server is not None and not self.server.force_exit:
                log.info("%s received again: already stopping; not waiting for connections to close", name)
                self.server.force_exit = True
            return
        self.signal = signum
        log.info("%s received: stopping", name)
        # NOTE: cancel only once: a second cancel would interrupt the cleanup `start` runs when
        # cancelled (terminating the stage processes, sweeping their shared memory).
        if self.start_task is not None and not self.start_task.done():
            self.start_task.cancel()
        if self.server is not None:
            self.server.should_exit = True


async def _serve_until_stopped(cfg: PipelineConfig, options: ServeOptions) -> int:
    loop = asyncio.get_running_loop()
    stopper = _Stopper()
    for signum in _STOP_SIGNALS:
        loop.add_signal_handler(signum, stopper, signum)  # NOTE: removed by loop.close()
    flusher = loop.create_task(_flush_logs_forever())
    try:
        return await _serve(cfg, options, stopper)
    finally:
        flusher.cancel()


async def _serve(cfg: PipelineConfig, options: ServeOptions, stopper: _Stopper) -> int:
    try:
        sock = bind_socket(options.host, options.port)
    except OSError as exc:
        raise ServeError(f"cannot bind {options.host}:{options.port}: {exc.strerror or exc}") from exc
    with sock:
        try:
            coordinator = Coordinator(cfg)
            # NOTE: checked already (`check-config` runs before `serve`): this only builds what the endpoint reads.
            twilio = twilio_settings(cfg)
        except Exception as exc:
            raise ServeError(f"{type(exc).__name__}: {exc}") from exc
        app = create_app(coordinator, options.sessions, twilio, web_dir=options.web_dir)
        stopper.server = server = _Server(_uvicorn_config(app, options))
        serving = asyncio.ensure_future(_run_http(server, sock))
        try:
            return await _start_and_serve(cfg, options, coordinator, server, serving, stopper)
        finally:
            # NOTE: HTTP first (open sessions end their responses while the stages still run), then the stages.
            server.should_exit = True
            with contextlib.suppress(ServeError):
                await serving
            await coordinator.stop()


async def _run_http(server: _Server, sock: Any) -> None:
    try:
        await server.serve(sockets=[sock])
    except (SystemExit, OSError) as exc:  # NOTE: uvicorn exits on a failed start after logging why
        raise ServeError(f"the HTTP server did not start: {exc!r}") from exc


async def _start_and_serve(
    cfg: PipelineConfig, options: ServeOptions, coordinator: Coordinator, server: _Server,
    serving: asyncio.Future[None], stopper: _Stopper,
) -> int:
    while not server.started:  # NOTE: listen first, so clients see 503/1013 rather than refused connections
        if serving.done():
            await serving  # raises ServeError if uvicorn failed to start
            return EXIT_STOPPED
        await asyncio.sleep(_LISTEN_POLL_S)
    if stopper.signal is not None:
        return EXIT_STOPPED
    log.info("listening on http://%s:%d; the stages are starting", options.host, options.port)
    stopper.start_task = start = asyncio.ensure_future(coordinator.start())
    await asyncio.wait({start, serving}, return_when=asyncio.FIRST_COMPLETED)
    if not start.done():  # NOTE: uvicorn stopped (or failed) while the stages were loading
        # NOTE: not twice: after a stop signal's cancel, `start` is stopping what it launched, and a
        # second cancel cut that short (a run directory left behind, found with a stop ~1 s into start-up).
        if not start.cancelling():
            start.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await start
        await serving
        return EXIT_STOPPED
    try:
        start.result()
    except asyncio.CancelledError:
        if stopper.signal is None:
            raise
        log.info("stopped while the stages were starting")
        return EXIT_STOPPED
    except StartupError as exc:
        raise ServeError(describe_startup_error(cfg, coordinator, exc)) from exc
    except Exception as exc:
        raise ServeError(f"{type(exc).__name__}: {exc}") from exc
    if stopper.signal is not None:
        return EXIT_STOPPED
    limits, sessions = options.limits, options.sessions
    log.info(
        "serving http://%s:%d (max_connections %d, request_head_timeout_s %g, keep_alive_timeout_s %g, "
        "max_sessions %s, auth %s, idle_timeout_s %s)",
        options.host, options.port, limits.max_connections, limits.request_head_timeout_s,
        limits.keep_alive_timeout_s, sessions.max_sessions, "on" if sessions.auth_token else "off",
        sessions.idle_timeout_s,
    )
    await serving
    return EXIT_STOPPED


def describe_startup_error(cfg: PipelineConfig, coordinator: Coordinator, exc: StartupError) -> str:
    """The coordinator's error plus the config fields behind it (each failed stage's factory, or the
    pipeline's `startup_timeout_s` when a stage was merely slow)."""
    launcher = getattr(coordinator, "launcher", None)  # NOTE: absent if start failed before spawning
    handles = launcher.handles if launcher is not None else {}
    failed = {name: h.last_error for name, h in handles.items() if h.last_error}
    text = str(exc)
    details = []
    for name in failed:
        stages = cfg.processes.get(name, ())
        # NOTE: a cause that names its stage already names the field (config errors do).
        details += [f"stage '{s.name}' has factory {s.factory}" for s in stages if f"stage '{s.name}'" not in text]
    if not failed:
        details.append(
            f"the pipeline's startup_timeout_s is {cfg.startup_timeout_s:g} s; raise it if a stage loads for longer"
        )
    return f"{text} ({'; '.join(details)})" if details else text


def _uvicorn_config(app: Any, options: ServeOptions) -> uvicorn.Config:
    limits = options.limits
    return uvicorn.Config(
        app,
        host=options.host,
        port=options.port,
        http=protocol_class(limits),
        lifespan="on",
        log_config=None,  # NOTE: uvicorn's loggers propagate to the root handler, which is rate-limited
        log_level=options.log_level,
        backlog=limits.backlog,
        timeout_graceful_shutdown=limits.shutdown_grace_s,
        ws_max_size=options.sessions.max_message_bytes,
    )


async def _flush_logs_forever() -> None:
    while True:
        await asyncio.sleep(_LOG_FLUSH_INTERVAL_S)
        flush_rate_limits()
