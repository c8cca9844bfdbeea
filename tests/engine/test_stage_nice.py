"""The stage field `nice`: checked range, one priority per process group, and set in the stage process, for
every one of its threads, at start."""

from __future__ import annotations

import os
from typing import Any

import pytest
from harness import Pipeline

from voice_server.config import ConfigError, pipeline_from_dict

REPORTER = "env_stages:create_priority_reporter"


def config(nice_a: Any, nice_b: Any = 0, process_b: str = "") -> dict[str, Any]:
    return {
        "name": "nice-test",
        "stages": [
            {"name": "a", "factory": REPORTER, "next": "b", "nice": nice_a},
            {"name": "b", "factory": REPORTER, "terminal": True, "nice": nice_b, "process": process_b},
        ],
    }


@pytest.mark.parametrize("nice", [20, -21, "5", True, 2.5])
def test_a_bad_nice_is_refused_naming_stage_and_field(nice: Any) -> None:
    with pytest.raises(ConfigError) as info:
        pipeline_from_dict(config(nice))
    assert str(info.value).startswith("stage 'a': field 'nice'"), str(info.value)


def test_stages_of_one_process_agree_on_its_priority() -> None:
    with pytest.raises(ConfigError, match=r"stage 'b': field 'nice': differs from the nice of stage 'a': both run in "
                                          r"process 'a', which has one priority"):
        pipeline_from_dict(config(5, 3, process_b="a"))
    assert pipeline_from_dict(config(5, 5, process_b="a")).process_nice("a") == 5
    cfg = pipeline_from_dict(config(7))
    assert (cfg.process_nice("a"), cfg.process_nice("b"), cfg.stages[1].nice) == (7, 0, 0)


def test_each_stage_process_and_all_its_threads_run_at_its_nice() -> None:
    base = os.getpriority(os.PRIO_PROCESS, 0)
    nice_a = min(19, base + 5)  # NOTE: a lower priority than the server's needs no privilege
    pipeline = Pipeline(pipeline_from_dict(config(nice_a, base)))
    try:
        [out] = pipeline.collect({"x": 1})
    finally:
        pipeline.close()
    assert out.payload["a"] == [nice_a] and out.payload["b"] == [base]
    assert os.getpriority(os.PRIO_PROCESS, 0) == base  # NOTE: the server keeps its own
