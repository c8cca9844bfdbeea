"""Test stages for Qwen3-Omni pipelines in real stage processes.

`create_recorder`: a terminal stage that reports what it received from the stage before it (every
payload key as it arrived through the relay), standing in for the thinker behind the encoder.
"""

from __future__ import annotations

from voice_server.engine.runtime import StageContext
from voice_server.scheduling import Emit, EmitKind, Runner, SimpleBatch, SimpleResult


class Recorder(Runner[SimpleBatch, SimpleResult]):
    def execute(self, batch: SimpleBatch) -> SimpleResult:
        # NOTE: the payload goes back as it came (relayed arrays are sent on again), plus its keys,
        # so a test sees exactly what a downstream stage would have been given.
        return SimpleResult(tuple(
            Emit(item.request_id, EmitKind.RESULT, {**item.payload, "received_keys": sorted(item.payload)})
            for item in batch.items
        ))


def create_recorder(ctx: StageContext) -> Recorder:
    return Recorder()
