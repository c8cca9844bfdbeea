"""`make system-deps`, the first step of `make test`: it finds the system packages the tests drive, and
where it cannot install the missing ones it stops at once with one line naming them and the command.

The install path itself (root, apt-get) is what CI's clean clone on a fresh machine runs.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
NOBODY = 65534


def _make_system_deps(env: dict[str, str], as_nobody: bool) -> tuple[subprocess.CompletedProcess[str], float]:
    make = shutil.which("make")
    assert make is not None, "make is what runs these tests"
    drop = ["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups"] if as_nobody else []
    # NOTE: a make of its own, not a sub-make of the `make test` that runs these tests.
    outer = {k: v for k, v in os.environ.items() if k not in ("MAKEFLAGS", "MAKELEVEL", "MFLAGS")}
    start = time.monotonic()
    done = subprocess.run([*drop, make, "--no-print-directory", "-C", str(ROOT), "system-deps"],
                          capture_output=True, text=True, env={**outer, **env}, timeout=60)
    return done, time.monotonic() - start


def test_present_packages_need_nothing() -> None:
    """Everything found (here through the variables the tests read): silent, exit 0, nothing installed."""
    # NOTE: checked first, so that this test never runs apt-get itself.
    if shutil.which("g++") is None:
        pytest.fail("g++ is one of make test's system packages; make system-deps installs it")
    done, _ = _make_system_deps({"VOICE_SERVER_CHROMIUM": "/bin/true", "VOICE_SERVER_NGINX": "/bin/true"},
                                as_nobody=False)
    assert done.returncode == 0, done.stderr
    assert done.stdout == "" and done.stderr == ""


@pytest.mark.environment
def test_without_root_or_sudo_one_line_names_the_packages_and_the_command() -> None:
    if os.geteuid() != 0 or shutil.which("setpriv") is None:
        pytest.skip("environment: needs root and setpriv to run make as an unprivileged user")
    # NOTE: nobody has no sudo; the two variables point the checks at paths that do not exist.
    done, seconds = _make_system_deps(
        {"VOICE_SERVER_CHROMIUM": "/nonexistent/chromium", "VOICE_SERVER_NGINX": "/nonexistent/nginx"},
        as_nobody=True,
    )
    assert done.returncode == 2, (done.stdout, done.stderr)
    ours = [line for line in done.stderr.splitlines() if not re.match(r"make(\[\d+\])?: \*\*\*", line)]
    assert ours == ["make test needs system packages: chromium nginx; install them "
                    "(sudo apt-get install -y chromium nginx) and rerun"], done.stderr
    assert "apt-get update" not in done.stdout
    assert seconds < 5, f"the check took {seconds:.1f} s; it should stop before anything else runs"
