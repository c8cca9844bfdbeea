"""A stage that reports its process's environment, for the `env` stage field (tests/engine/test_stage_env.py).

`create_env_reporter`: a `simple` stage that adds `{stage name: {NAME: os.environ.get(NAME)}}` to the
payload it passes on, for every NAME in the payload's `names`; chained stages accumulate their reports.
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
