"""Whole sessions under faults (issue #11): real servers and clients, the helpers of tests/server."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(1, str(Path(__file__).resolve().parents[1] / "server"))
