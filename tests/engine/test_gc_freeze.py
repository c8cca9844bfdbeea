"""A stage process freezes its start-up heap (`voice_server/engine/runtime.py: freeze_startup_heap`): what its
runners loaded sits in the collector's permanent generation, which full collections never scan; what a request
makes later is collected as usual. Outside a stage process (`create_runner` without the shell's `report`)
nothing is frozen."""

from __future__ import annotations

import gc

from gc_stages import GcReporter
from harness import Pipeline

from voice_server.config import pipeline_from_dict
from voice_server.engine.runtime import StageContext, create_runner

REPORTER = "gc_stages:create_gc_reporter"


def test_each_runner_loaded_in_a_stage_process_is_frozen_and_requests_are_not() -> None:
    # NOTE: `b` shares `a`'s process: it loads after `a`'s freeze, and is frozen by its own; `c` has its own.
    cfg = pipeline_from_dict({"name": "gc-test", "stages": [
        {"name": "a", "factory": REPORTER, "next": "b"},
        {"name": "b", "factory": REPORTER, "next": "c", "process": "a"},
        {"name": "c", "factory": REPORTER, "terminal": True},
    ]})
    pipeline = Pipeline(cfg)
    try:
        outs = pipeline.collect({"x": 1})
    finally:
        pipeline.close()
    seen = {name: report for out in outs for name, report in out.payload.items() if name != "x"}
    assert set(seen) == {"a", "b", "c"}, outs
    for name, report in seen.items():
        # NOTE: numpy, zmq and the engine are imported by then: thousands of objects.
        assert report["num_frozen"] > 1000, (name, report)
        assert report["is_startup_frozen"] and not report["is_request_frozen"], (name, report)


def test_a_runner_built_outside_a_stage_process_freezes_nothing() -> None:
    cfg = pipeline_from_dict({"name": "gc-test", "stages": [{"name": "a", "factory": REPORTER, "terminal": True}]})
    num_frozen = gc.get_freeze_count()
    runner = create_runner(StageContext(cfg.stages[0], cfg, None, "test"))
    assert isinstance(runner, GcReporter)
    assert gc.get_freeze_count() == num_frozen
