"""A stage whose runner gave up batch invariance at start-up (its BLAS rounds every row count its own
way) still serves, and says so: `/health` shows `runner.batch_invariant: false` under the stage."""

from __future__ import annotations

import json
import sys
import urllib.request
from collections.abc import Callable
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from serving import ServerProcess  # noqa: E402

TESTS = Path(__file__).resolve().parents[1]


def test_health_shows_a_runner_without_batch_invariance(
    serve_process: Callable[..., ServerProcess], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    config = tmp_path / "pipeline.yaml"
    config.write_text(
        "name: no-invariant-rows\nstages:\n"
        "  - {name: llm, factory: 'row_stand_ins:create_count_dependent_llm', scheduler: ar, terminal: true,\n"
        "     memory_fraction: 0.02, max_batch_size: 4, max_step_tokens: 64}\n"
    )
    monkeypatch.setenv("PYTHONPATH", str(TESTS))  # NOTE: the stage process imports `row_stand_ins`
    server = serve_process(config=config, log_level="warning")
    server.wait_healthy(120)
    with urllib.request.urlopen(f"http://127.0.0.1:{server.port}/health", timeout=5) as resp:
        health = json.loads(resp.read())
    assert health["stages"]["llm"]["runner"] == {
        "batch_invariant": False, "step_rows": "rows as they come (not batch invariant)"}, health
    warnings = [line for line in server.stderr.splitlines() if "batch_invariant: no padding" in line]
    assert len(warnings) == 1 and "CountDependentLinear" in warnings[0], server.stderr
