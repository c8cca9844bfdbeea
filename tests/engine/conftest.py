from __future__ import annotations

from collections.abc import Iterator

import pytest
from harness import CONFIGS, Pipeline, shm_segments

from voice_server.config import load_pipeline


@pytest.fixture(scope="module")
def numeric() -> Iterator[Pipeline]:
    pipeline = Pipeline(load_pipeline(CONFIGS / "test_numeric.yaml"))
    yield pipeline
    pipeline.close()
    assert shm_segments(pipeline.coordinator.launch_id) == []
