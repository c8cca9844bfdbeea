"""Shared test setup.

NOTE: one intra-op thread everywhere: on a 2-core box tiny torch ops are ~100x slower with two.
The variable is set before torch is imported so spawned stage processes inherit it too.
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("MKL_NUM_THREADS", "1")
