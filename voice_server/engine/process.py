"""A stage process: what it is given at spawn, and its entry point around the StageShell."""

from __future__ import annotations

import logging
import os
import signal
from dataclasses import dataclass

import setproctitle

from voice_server.config import PipelineConfig
from voice_server.engine import ipc
from voice_server.engine.limits import EngineLimits
from voice_server.engine.stage import StageShell
from voice_server.logs import flush_rate_limits, install_rate_limit


@dataclass(frozen=True)
class ProcessSpec:
    launch_id: str
    process: str
    generation: int
    pipeline: PipelineConfig
    budgets: dict[str, int | None]
    endpoints: ipc.Endpoints
    """Addresses and (tcp) the launch's CURVE keys: handed over at spawn, never on the wire."""
    limits: EngineLimits
    log_level: int = logging.INFO
    """The server's log level, so `--log-level debug` reaches the stages too."""


def set_priority(nice: int, process: str) -> None:
    """This process's CPU priority (the stage field `nice`, `config/priority.py`); a warning, not a failure,
    where the process may not take it (a value below its current one, without CAP_SYS_NICE)."""
    try:
        if os.getpriority(os.PRIO_PROCESS, 0) != nice:
            os.setpriority(os.PRIO_PROCESS, 0, nice)
    except OSError as exc:
        logging.getLogger(__name__).warning(
            "stage process '%s': cannot set its priority to nice %d (%s); it runs at nice %d", process, nice,
            exc.strerror, os.getpriority(os.PRIO_PROCESS, 0))


def _exit_now(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)


def run_stage_process(spec: ProcessSpec) -> None:
    """Entry point of a spawned stage process."""
    # NOTE: Ctrl-C reaches the whole process group; the server shuts stages down in order instead.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    ipc.die_with_parent()
    # NOTE: operators find stage processes by name (`ps`), since /health publishes no PIDs.
    setproctitle.setproctitle(f"voice-server[{spec.process}]")
    logging.basicConfig(level=spec.log_level, format=f"%(asctime)s [{spec.process}] %(levelname)s %(message)s")
    install_rate_limit()  # NOTE: a flood of bad messages must not flood the log
    set_priority(spec.pipeline.process_nice(spec.process), spec.process)
    # NOTE: until the stage reports ready, SIGTERM ends the process at once (SystemExit unwinds a
    # factory that is still loading, and `close` still runs); afterwards it stops the loop cleanly.
    signal.signal(signal.SIGTERM, _exit_now)
    shell = StageShell(spec)
    try:
        shell.run()
    finally:
        shell.close()
        flush_rate_limits(is_final=True)


