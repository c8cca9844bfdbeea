"""Under VOICE_SERVER_NO_SKIP=1 (set by `make test`) a skip fails, except for `environment`-marked tests."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

CASES = '''
import pytest


def test_plain_skip():
    pytest.skip("dev dependency missing")


@pytest.mark.skipif(True, reason="no reason")
def test_skipif():
    pass


@pytest.mark.environment
@pytest.mark.skipif(True, reason="environment: needs root")
def test_environment_skip():
    pass


@pytest.mark.xfail(reason="known")
def test_xfail():
    raise AssertionError


def test_passes():
    pass
'''
MISSING = 'import pytest\n\npytest.importorskip("no_such_module_voice_server")\n\n\ndef test_x():\n    pass\n'


def _run(tmp_path: Path, no_skip: bool) -> str:
    shutil.copy(Path(__file__).with_name("conftest.py"), tmp_path / "conftest.py")
    (tmp_path / "test_cases.py").write_text(CASES)
    (tmp_path / "test_missing.py").write_text(MISSING)
    env = {**os.environ, "VOICE_SERVER_NO_SKIP": "1" if no_skip else "0"}
    out = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-rfEs", "-p", "no:cacheprovider", "-p", "no:randomly",
         "--continue-on-collection-errors", "--rootdir", str(tmp_path), "-c", os.devnull, str(tmp_path)],
        capture_output=True, text=True, env=env, cwd=tmp_path, timeout=120,
    )
    return out.stdout + out.stderr


def test_skips_fail_under_no_skip(tmp_path: Path) -> None:
    out = _run(tmp_path, no_skip=True)
    assert "1 failed, 1 passed, 1 skipped, 1 xfailed, 2 errors" in out  # skipif fails in setup: an error, out
    assert "skipped under VOICE_SERVER_NO_SKIP=1 (dev dependency missing)" in out, out
    assert "test_missing.py skipped at collection under VOICE_SERVER_NO_SKIP=1" in out, out


def test_skips_stay_skips_otherwise(tmp_path: Path) -> None:
    out = _run(tmp_path, no_skip=False)
    assert "1 passed, 4 skipped, 1 xfailed" in out, out
