"""Stages that report their process's environment and priority, for the `env` and `nice` stage fields
(tests/engine/test_stage_env.py, tests/engine/test_stage_nice.py).

`create_env_reporter`: a `simple` stage that adds `{stage name: {NAME: os.environ.get(NAME)}}` to the
payload it passes on, for every NAME in the payload's `names`; chained stages accumulate their reports.
`create_priority_reporter`: likewise `{stage name: the nice values of its process's threads}`.
"""

from __future__ import annotations

import os

from voice_server.engine.runtime import StageContext
from voice_server.scheduling import Emit, EmitKind, Runner, SimpleBatch, SimpleResult


class EnvReporter(Runner[SimpleBatch, SimpleResult]):
    def __init__(self, stage: str) -> None:
        self.stage = stage

    def execute(self, batch: SimpleBatch) -> SimpleResult:
        emits = []
        for item in batch.items:
            seen = {name: os.environ.get(name) for name in item.payload["names"]}
            emits.append(Emit(item.request_id, EmitKind.RESULT, {**item.payload, self.stage: seen}))
        return SimpleResult(tuple(emits))


def create_env_reporter(ctx: StageContext) -> EnvReporter:
    return EnvReporter(ctx.stage.name)


class PriorityReporter(Runner[SimpleBatch, SimpleResult]):
    """Adds `{stage name: sorted nice values of its process's threads}` to the payload it passes on."""

    def __init__(self, stage: str) -> None:
        self.stage = stage

    def execute(self, batch: SimpleBatch) -> SimpleResult:
        # NOTE: every thread, from /proc (field 19 of a task's stat is its nice): Linux keeps a priority per
        # thread, so threads started before the process set its priority would have kept the old one.
        values = set()
        for tid in os.listdir("/proc/self/task"):
            with open(f"/proc/self/task/{tid}/stat") as f:
                values.add(int(f.read().rsplit(")", 1)[1].split()[16]))
        emits = [Emit(item.request_id, EmitKind.RESULT, {**item.payload, self.stage: sorted(values)})
                 for item in batch.items]
        return SimpleResult(tuple(emits))


def create_priority_reporter(ctx: StageContext) -> PriorityReporter:
    return PriorityReporter(ctx.stage.name)
