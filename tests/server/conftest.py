"""`serve_process(...)`: start `voice-server serve` as a real process; all are killed at teardown."""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from serving import Launcher, ServerProcess  # noqa: E402


@pytest.fixture
def serve_process(tmp_path: Path) -> Iterator[Callable[..., ServerProcess]]:
    launcher = Launcher(tmp_path)
    yield launcher.start
    launcher.close()
