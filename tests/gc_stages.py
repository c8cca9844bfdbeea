"""A stage that reports the garbage collector's state in its process (tests/engine/test_gc_freeze.py).

`create_gc_reporter`: a `simple` stage that keeps an object it made at start-up and adds, to the payload it
passes on, `{stage name: {"num_frozen", "is_startup_frozen", "is_request_frozen"}}`: how many objects the
process froze, and whether its start-up object and one made for this request sit in the permanent generation.
"""

from __future__ import annotations

import gc

from voice_server.engine.runtime import StageContext
from voice_server.scheduling import Emit, EmitKind, Runner, SimpleBatch, SimpleResult


def is_frozen(obj: object) -> bool:
    """Tracked by the collector, yet in none of its generations: in the permanent one (`gc.freeze`)."""
    return gc.is_tracked(obj) and not any(o is obj for o in gc.get_objects())


class GcReporter(Runner[SimpleBatch, SimpleResult]):
    def __init__(self, stage: str) -> None:
        self.stage = stage
        self.loaded = {"weights": [1.0, 2.0]}  # NOTE: stands for what a factory loads

    def execute(self, batch: SimpleBatch) -> SimpleResult:
        emits = []
        for item in batch.items:
            state = {"request": [item.request_id]}
            seen = {"num_frozen": gc.get_freeze_count(), "is_startup_frozen": is_frozen(self.loaded),
                    "is_request_frozen": is_frozen(state)}
            emits.append(Emit(item.request_id, EmitKind.RESULT, {**item.payload, self.stage: seen}))
        return SimpleResult(tuple(emits))


def create_gc_reporter(ctx: StageContext) -> GcReporter:
    return GcReporter(ctx.stage.name)
