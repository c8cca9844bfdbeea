"""`voice-server ask` against the shipped configs/llm-cpu.yaml: real stage process, SmolLM2 int4,
the reply streamed to stdout and a summary on stderr; a bad config is one line with exit 2."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def run_ask(*args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "-m", "voice_server.cli", "ask", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=180)


def test_ask_streams_an_answer_from_the_llm_cpu_pipeline() -> None:
    done = run_ask("What is the capital of France?", "--config", "configs/llm-cpu.yaml", "--max-tokens", "24")
    assert done.returncode == 0, done.stderr
    assert "Paris" in done.stdout
    assert "tokens, finish stop" in done.stderr and "first token" in done.stderr


def test_ask_with_a_bad_config_is_one_line_and_exit_2(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: x\nstages:\n  - {name: t, factory: 'voice_server.stages.llm:create_llm', scheduler: ar, "
                   "terminal: true, max_step_tokens: 0}\n")
    done = run_ask("hi", "--config", str(bad))
    assert done.returncode == 2
    assert done.stderr.startswith("config error:") and "max_step_tokens" in done.stderr
    assert done.stderr.count("\n") == 1
