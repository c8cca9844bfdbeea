"""What each `voice-server` subcommand does: `check-config`, `serve` and `ask`, from a config path to an exit code.

Apart from the command line (`voice_server/cli.py`, flags and dispatch) because these run the checks and
start the server; the parser only turns argv into their arguments.

NOTE: only the standard library at import, as `voice_server/cli.py`: the config package and the server
are imported inside each command.
"""

from __future__ import annotations

import signal
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from voice_server.config import PipelineConfig


def describe_topology(cfg: PipelineConfig) -> str:
    lines = [f"pipeline '{cfg.name}': entry {cfg.entry_stage}, terminal {', '.join(cfg.terminal_stages)}"]
    for stage in cfg.stages:
        routes = []
        if stage.next:
            routes.append(f"next -> {stage.next}")
        if stage.stream_to:
            routes.append(f"stream -> {', '.join(stage.stream_to)}")
        if stage.terminal:
            routes.append("-> client")
        lines.append(
            f"  {stage.name:<12} [{stage.scheduler}] process={stage.process_name} device={stage.device} "
            f"factory={stage.factory}  {'; '.join(routes)}"
        )
    return "\n".join(lines)


def check_config(path: str, *, show_traceback: bool = False, is_device_check: bool = True) -> int:
    """Validate a config and this host's fit for it without starting anything; print topology and budget.

    Exit 0 when it can start, 2 with one `config error: ...` paragraph when it cannot, 1 (one line) on an
    unexpected failure of the checker itself (`--traceback` shows where).
    """
    from voice_server.config import ConfigError, format_budget, load_pipeline, plan_budget
    from voice_server.config.budget import plan_memory
    from voice_server.config.checks import check_environment
    from voice_server.config.errors import one_line
    from voice_server.scheduling import check_schedulers
    from voice_server.session.twilio.settings import twilio_settings

    try:
        cfg = load_pipeline(path)
        budgets = plan_budget(cfg)
        check_schedulers(cfg)
        check_environment(cfg, is_device_check=is_device_check)
        twilio_settings(cfg)  # NOTE: the `twilio:` tools' own rules (JSON schemas) are the session layer's parser's
    except ConfigError as exc:
        # NOTE: one_line is a last guarantee of one paragraph; messages are built as one line already.
        print(f"config error: {one_line(str(exc), max_len=2000)}", file=sys.stderr)
        return 2
    except Exception as exc:
        if show_traceback:
            raise
        print(f"error: checking {path} failed unexpectedly ({one_line(f'{type(exc).__name__}: {exc}')}); "
              "this is a bug, rerun with --traceback for where", file=sys.stderr)
        return 1
    print(describe_topology(cfg))
    print()
    print(format_budget(budgets, plan_memory(cfg)))
    if not is_device_check and any(s.device != "cpu" for s in cfg.stages):
        print("\nnote: --skip-device-check: this host was not checked for the cuda devices above")
    if cfg.launcher == "ray":
        return _check_cluster(cfg)
    return 0


def _check_cluster(cfg: PipelineConfig) -> int:
    """`launcher: ray`: the placements against the cluster when one answers at `ray_address` (exit 2 when a
    placement fits no live node), a note when none does."""
    from voice_server.config import ConfigError
    from voice_server.config.errors import one_line

    try:
        from voice_server.engine.ray_launch import check_cluster
    except ImportError as exc:
        print(f"config error: pipeline '{cfg.name}': field 'launcher': ray needs the ray extra "
              f"(pip install -e '.[ray]'): {one_line(str(exc))}", file=sys.stderr)
        return 2
    try:
        lines = check_cluster(cfg)
    except ConfigError as exc:
        print(f"config error: {one_line(str(exc), max_len=2000)}", file=sys.stderr)
        return 2
    except (RuntimeError, ConnectionError) as exc:
        print(f"\nnote: no Ray cluster answers at {cfg.ray_address} ({one_line(str(exc), max_len=200)}): the "
              "placements were not checked")
        return 0
    print(f"\nplacement on the Ray cluster at {cfg.ray_address} (the nodes each process fits):")
    print("\n".join(lines))
    return 0


def load_for_launch(path: str) -> PipelineConfig | None:
    """The config, checked as `check-config` checks it; None after printing its one `config error` line."""
    from voice_server.config import ConfigError, load_pipeline, plan_budget
    from voice_server.config.errors import one_line

    try:
        cfg = load_pipeline(path)
        plan_budget(cfg)
    except ConfigError as exc:
        print(f"config error: {one_line(str(exc), max_len=2000)}", file=sys.stderr)
        return None
    from voice_server.config.child_check import check_in_child

    failure = check_in_child(path)
    if failure is not None:
        print(failure, file=sys.stderr)
        return None
    return cfg


def serve(path: str, host: str, port: int, log_level: str, limits: dict[str, Any],
          sessions: dict[str, Any] | None = None, web_dir: str | None = None) -> int:
    """Exit 0 after SIGTERM/SIGINT (at any point, start-up included), 2 on a config or start-up error."""
    # NOTE: until the event loop takes both signals over (`server/runner.py`), a stop signal interrupts
    # what runs: the imports (~1 s) or the config check, whose child `check_in_child` kills. Nothing
    # else has started, so whatever that raises is only the stop: an import interrupted halfway can
    # raise something else (a NameError from a module's `except` clause) in place of KeyboardInterrupt.
    early = _EarlyStop()
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, early)
    try:
        return _serve(path, host, port, log_level, limits, sessions, web_dir)
    except BaseException:
        if early.signum is None:
            raise
        return 0


class _Stopped(KeyboardInterrupt):
    """KeyboardInterrupt to every `except`, but not to CPython's exit: a KeyboardInterrupt of exactly that
    type raised through a C extension's `PyRun_String` (some run one at import) makes `python -m` end by
    re-raising SIGINT once `main` has returned, even though `serve` caught it."""


class _EarlyStop:
    def __init__(self) -> None:
        self.signum: int | None = None

    def __call__(self, signum: int, frame: object) -> None:
        self.signum = signum
        raise _Stopped


def _serve(path: str, host: str, port: int, log_level: str, limits: dict[str, Any],
           sessions: dict[str, Any] | None, web_dir: str | None) -> int:
    cfg = load_for_launch(path)
    if cfg is None:
        return 2
    from voice_server.server.http import HttpLimits, raise_nofile_limit
    from voice_server.server.runner import ServeOptions, configure_logging, run_server
    from voice_server.server.session_limits import SessionLimits

    configure_logging(log_level)
    raise_nofile_limit()  # NOTE: before HttpLimits, whose default max_connections derives from it
    try:
        http_limits = HttpLimits(**{k: v for k, v in limits.items() if v is not None})
        session_limits = SessionLimits(**(sessions or {}))
    except ValueError as exc:
        print(f"config error: {exc}", file=sys.stderr)
        return 2
    return run_server(cfg, ServeOptions(host, port, log_level, http_limits, session_limits,
                                        Path(web_dir) if web_dir is not None else None))


def ask(path: str, question: str, system: str | None, max_tokens: int | None, log_level: str) -> int:
    """Exit 0 after a reply, 1 when the request failed, 2 on a config or start-up error."""
    cfg = load_for_launch(path)
    if cfg is None:
        return 2
    from voice_server.server.ask import run_ask
    from voice_server.server.runner import configure_logging

    configure_logging(log_level)
    return run_ask(cfg, question, system, max_tokens)
