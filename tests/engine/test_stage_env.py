"""The stage field `env`: checked names and values, one environment per process group, and applied in
the stage process before its modules load."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from harness import Pipeline

from voice_server.config import ConfigError, pipeline_from_dict

REPORTER = "env_stages:create_env_reporter"
REPO = Path(__file__).resolve().parents[2]


def config(env_a: Any, env_b: Any, process_b: str = "") -> dict[str, Any]:
    return {
        "name": "env-test",
        "stages": [
            {"name": "a", "factory": REPORTER, "next": "b", "env": env_a},
            {"name": "b", "factory": REPORTER, "terminal": True, "env": env_b, "process": process_b},
        ],
    }


@pytest.mark.parametrize(
    ("env", "needle"),
    [
        ({"CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": 30}, "field 'env.CUDA_MPS_ACTIVE_THREAD_PERCENTAGE': must be a string"),
        ({"lower_case": "1"}, "field 'env.lower_case': name 'lower_case' must match"),
        ({"A-B": "1"}, "field 'env.A-B'"),
        ({1: "1"}, "field 'env': name 1 must match"),
        ({"PATH": "/usr/bin"}, "field 'env.PATH': may not be set per stage"),
        ({"CUDA_VISIBLE_DEVICES": "1"}, "choose the GPU with `device: cuda:N`"),
        ({"LD_PRELOAD": "x.so"}, "field 'env.LD_PRELOAD': may not be set per stage: read by the dynamic loader"),
        ({"PYTHONPATH": "x"}, "field 'env.PYTHONPATH': may not be set per stage"),
        ({"VOICE_SERVER_RUN_DIR": "x"}, "reserved for the server"),
        ({"X": "a\nb"}, "field 'env.X': must be printable"),
        ({"X": "y" * 1025}, "field 'env.X': must be printable and at most 1024"),
        ({f"V{i}": "1" for i in range(33)}, "field 'env': 33 variables is more than the 32"),
        (["X=1"], "field 'env': must be a mapping"),
    ],
)
def test_bad_env_is_refused_naming_stage_and_field(env: Any, needle: str) -> None:
    with pytest.raises(ConfigError) as info:
        pipeline_from_dict(config(env, {}))
    assert str(info.value).startswith("stage 'a': field 'env"), str(info.value)
    assert needle in str(info.value)


def test_stages_of_one_process_may_not_disagree() -> None:
    same = {"CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": "30"}
    other = {"CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": "50"}
    with pytest.raises(ConfigError, match=(
        r"stage 'b': field 'env.CUDA_MPS_ACTIVE_THREAD_PERCENTAGE': '50' conflicts with '30' from stage 'a': "
        r"both run in process 'a'"
    )):
        pipeline_from_dict(config(same, other, process_b="a"))
    # Agreeing values, disjoint names, and separate processes are all fine.
    cfg = pipeline_from_dict(config({**same, "X": "1"}, {**same, "Y": "2"}, process_b="a"))
    assert cfg.process_env("a") == {**same, "X": "1", "Y": "2"}
    assert pipeline_from_dict(config(same, other)).process_env("b") == other
    assert pipeline_from_dict(config(None, {})).stages[0].env == {}


def test_each_stage_process_sees_its_own_env() -> None:
    parent_only = "VS_TEST_PARENT_ONLY"
    os.environ[parent_only] = "inherited"
    try:
        cfg = pipeline_from_dict(config({"VS_TEST_MARK": "alpha", "OMP_NUM_THREADS": "3"}, {"VS_TEST_MARK": "beta"}))
        pipeline = Pipeline(cfg)
        try:
            [out] = pipeline.collect({"names": ["VS_TEST_MARK", "OMP_NUM_THREADS", parent_only]})
        finally:
            pipeline.close()
    finally:
        del os.environ[parent_only]
    assert out.payload["a"] == {"VS_TEST_MARK": "alpha", "OMP_NUM_THREADS": "3", parent_only: "inherited"}
    assert out.payload["b"] == {"VS_TEST_MARK": "beta", "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS"),
                                parent_only: "inherited"}
    assert "VS_TEST_MARK" not in os.environ  # NOTE: applied in the child only, never in the server


def test_the_entry_point_imports_nothing_that_reads_the_env_at_load() -> None:
    # NOTE: the env must be in place before numpy (OpenBLAS threads) and torch (CUDA, allocator) load.
    code = ("import sys, voice_server.engine.bootstrap as b; "
            "print(sorted(m for m in ('numpy', 'torch', 'zmq', 'voice_server.engine.process') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60,
                         env={**os.environ, "PYTHONPATH": str(REPO)})
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"
