"""`check-config`, run by `serve` (and `ask`) before they start anything: one set of checks, one message.

A child process, because resolving the factories and counting GPUs import torch and model code, which
the server process must not hold (its stage processes load them). Standard library only here: the
server process imports this module.
"""

from __future__ import annotations

import subprocess
import sys

# NOTE: the child takes this process's sys.path, as multiprocessing's spawn hands it to the stage
# processes: a factory resolves in the check where it will resolve in its stage. `--` keeps a path
# that starts with '-' a path.
_CHECK_CHILD = (
    "import sys; sys.path[:] = sys.argv[2:]; from voice_server.cli import main; "
    "sys.exit(main(['check-config', '--', sys.argv[1]]))"
)
_OWN_LINES = ("config error: ", "error: ")


def check_in_child(path: str) -> str | None:
    """`voice-server check-config PATH` in a child Python: None when it passes, else the line it printed.

    NOTE: the child has a session of its own, so a Ctrl-C at the terminal reaches only this process,
    whose `subprocess.run` kills the child when interrupted (KeyboardInterrupt propagates).
    """
    out = subprocess.run(
        [sys.executable, "-c", _CHECK_CHILD, path, *sys.path],
        stdin=subprocess.DEVNULL, capture_output=True, text=True, errors="replace", start_new_session=True,
    )
    if out.returncode == 0:
        return None
    # NOTE: the last line of check-config's own: a factory module may have logged on stderr at import.
    lines = [line for line in out.stderr.splitlines() if line.startswith(_OWN_LINES)]
    if lines:
        return lines[-1]
    return f"error: `voice-server check-config {path}` failed with exit status {out.returncode}"
