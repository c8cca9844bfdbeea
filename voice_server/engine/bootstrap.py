"""The first code a spawned stage process runs: apply the stage's `env`, then load the rest.

NOTE: this module imports only the standard library, and the `ProcessSpec` arrives pickled as bytes,
so nothing of the engine (numpy) or of the stage (torch, CUDA) is imported before `os.environ` holds
the stage's `env`. multiprocessing's spawn unpickles a target's arguments before calling it: a
`ProcessSpec` argument would pull in `engine.process` and everything below it first. What still runs
earlier is the interpreter start and spawn's re-import of the server's `__main__` (the CLI, which
imports no torch).
"""

from __future__ import annotations

import os
import pickle


def start_stage_process(env: dict[str, str], spec_bytes: bytes) -> None:
    """Entry point of a spawned stage process: `env` first, then `engine.process.run_stage_process`."""
    os.environ.update(env)
    spec = pickle.loads(spec_bytes)  # NOTE: the parent pickled it; the same trust as spawn's own pickle
    from voice_server.engine.process import run_stage_process

    run_stage_process(spec)
