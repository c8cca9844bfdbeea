"""`serve_process(...)`: start `voice-server serve` as a real process; all are killed at teardown."""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from serving import Launcher, ServerProcess  # noqa: E402
from session_server import SessionServer, serve  # noqa: E402


@pytest.fixture
def serve_process(tmp_path: Path) -> Iterator[Callable[..., ServerProcess]]:
    launcher = Launcher(tmp_path)
    yield launcher.start
    launcher.close()


@pytest.fixture(scope="module")
def server() -> Iterator[SessionServer]:
    """An in-process uvicorn server over the stand-in speech stage, one per test module (`session_server`)."""
    yield from serve()
