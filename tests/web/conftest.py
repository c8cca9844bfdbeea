"""The browser demo's tests: their helpers (`demo_browser`) and the session servers of `tests/server`
(`session_server`, `live_server`) are importable from them."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "server"))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from session_server import SessionServer, serve  # noqa: E402


@pytest.fixture(scope="module")
def server() -> Iterator[SessionServer]:
    """An in-process uvicorn server over the stand-in speech stage, one per test module (`session_server`)."""
    yield from serve()
