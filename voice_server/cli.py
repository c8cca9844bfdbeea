"""`voice-server` command line: `serve` and `check-config`."""

from __future__ import annotations

import argparse
import logging
import sys

from voice_server.config import ConfigError, PipelineConfig, format_budget, load_pipeline, plan_budget
from voice_server.config.checks import check_environment
from voice_server.config.errors import one_line


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


def check_config(path: str, *, show_traceback: bool = False) -> int:
    """Validate a config and this host's fit for it without starting anything; print topology and budget.

    Exit 0 when it can start, 2 with one `config error: ...` paragraph when it cannot, 1 (one line) on an
    unexpected failure of the checker itself (`--traceback` shows where).
    """
    try:
        cfg = load_pipeline(path)
        budgets = plan_budget(cfg)
        check_environment(cfg)
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
    print(format_budget(budgets))
    return 0


def serve(path: str, host: str, port: int, log_level: str) -> int:
    try:
        cfg = load_pipeline(path)
        plan_budget(cfg)
    except ConfigError as exc:
        print(f"config error: {exc}", file=sys.stderr)
        return 2
    import uvicorn

    from voice_server.server.app import create_app

    logging.basicConfig(level=log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s")
    uvicorn.run(create_app(cfg), host=host, port=port, log_level=log_level)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="voice-server")
    sub = parser.add_subparsers(dest="command", required=True)
    p_serve = sub.add_parser("serve", help="launch the pipeline's stage processes and the HTTP/WebSocket server")
    p_serve.add_argument("--config", default="configs/default.yaml")
    p_serve.add_argument("--host", default="127.0.0.1")
    p_serve.add_argument("--port", type=int, default=8000)
    p_serve.add_argument("--log-level", default="info")
    p_check = sub.add_parser("check-config", help="validate a pipeline and print its topology and memory budget")
    p_check.add_argument("config")
    p_check.add_argument("--traceback", action="store_true", help="show the traceback of an unexpected failure")
    args = parser.parse_args(argv)
    if args.command == "serve":
        return serve(args.config, args.host, args.port, args.log_level)
    return check_config(args.config, show_traceback=args.traceback)


if __name__ == "__main__":
    sys.exit(main())
