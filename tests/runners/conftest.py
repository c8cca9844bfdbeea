"""Fixtures of the runner tests."""

from __future__ import annotations

import pytest
from omni_reference import TinyOmni


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> TinyOmni:
    """The seeded tiny Qwen3-Omni checkpoint saved for this module, with its transformers reference turns
    (tests/omni_reference.py). Modules that need another reference define their own `reference`."""
    return TinyOmni(tmp_path_factory.mktemp("tiny_qwen3_omni"))
