"""The C++ kernel build (`voice_server/kernels`) after a builder was SIGKILLed mid-compile, by two builders
at once: real processes building into a fresh `$TORCH_EXTENSIONS_DIR` (tens of seconds per build)."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

pytestmark = pytest.mark.long_running

ROOT = Path(__file__).resolve().parents[2]
BUILD = (
    "import logging, torch\n"
    "import voice_server.kernels as k\n"
    "logging.basicConfig(level=logging.INFO)\n"
    "assert k.available()\n"
    "print('impl', int(torch.ops.voice_server.best_impl()))\n"
)
BUILD_TIMEOUT_S = 240
"""Without the fix, a build after a killed one waits on torch's `lock` file forever: this turns that
hang into a failure."""


def _builder(ext_dir: Path) -> subprocess.Popen[str]:
    # NOTE: cwd=ROOT: `-c` imports this checkout's voice_server; its own session, so it can be killed
    # with everything it started in its group.
    env = {**os.environ, "TORCH_EXTENSIONS_DIR": str(ext_dir), "OMP_NUM_THREADS": "1"}
    env.pop("VOICE_SERVER_NO_KERNELS", None)
    return subprocess.Popen([sys.executable, "-c", BUILD], cwd=ROOT, env=env, start_new_session=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _finish(proc: subprocess.Popen[str]) -> tuple[int, str, str]:
    try:
        out, err = proc.communicate(timeout=BUILD_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        pytest.fail(f"the build did not finish within {BUILD_TIMEOUT_S} s:\n{err[-3000:]}")
    return proc.returncode, out, err


def _kill_all_under(path: Path) -> None:
    """SIGKILL what still runs in `path` (a killed build's compilers), so no test leaves them behind."""
    for pid in filter(str.isdigit, os.listdir("/proc")):
        with contextlib.suppress(OSError):
            if (os.readlink(f"/proc/{pid}/cwd") + os.sep).startswith(str(path.resolve()) + os.sep):
                os.kill(int(pid), signal.SIGKILL)


@pytest.fixture
def ext_dir(tmp_path: Path) -> Iterator[Path]:
    # NOTE: no skip without a compiler: like tests/models/test_kernels.py, g++ is part of the dev
    # environment (.ci/run installs it), so a build that fails for want of one is a failure.
    yield tmp_path / "torch_extensions"
    _kill_all_under(tmp_path)


@pytest.mark.timeout(600)
def test_builds_after_a_killed_build_succeed_and_take_turns(ext_dir: Path) -> None:
    first = _builder(ext_dir)
    build_dir = ext_dir / "voice_server_kernels"
    deadline = time.monotonic() + BUILD_TIMEOUT_S
    # NOTE: killed once ninja has recorded its first object, so the others are mid-compile: the dead
    # build leaves recorded objects, unrecorded (partial) ones and compilers still running.
    while not (build_dir / ".ninja_log").exists():
        assert first.poll() is None, f"the first build ended before it could be killed: {first.communicate()}"
        assert time.monotonic() < deadline, "the first build never got under way"
        time.sleep(0.05)
    os.killpg(first.pid, signal.SIGKILL)
    first.communicate()
    assert (build_dir / "lock").exists(), "torch's lock file is the stale state this test is about"

    # NOTE: two builders at once after the killed one (one full build for both checks): the first to take
    # the flock clears the stale lock and builds, the other waits on the flock and loads what it built.
    results = [_finish(p) for p in (_builder(ext_dir), _builder(ext_dir))]
    for code, out, err in results:
        assert code == 0 and out.startswith("impl "), err[-3000:]
    assert sum("left by a killed build" in err for _, _, err in results) == 1, [e[-2000:] for *_, e in results]
    assert any("waiting for another process's build" in err for _, _, err in results)
    assert not (build_dir / "lock").exists()
