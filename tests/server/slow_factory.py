"""A stage factory that loads for `factory_args.load_s` seconds (default 20): a stand-in for a big
model, for the signal-during-start-up and start-up-timeout tests. Imported by the stage process as
`slow_factory` (the tests put this directory on PYTHONPATH)."""

from __future__ import annotations

import time
from typing import Any

from voice_server.engine.runtime import StageContext
from voice_server.stages.numeric import create_echo


def create(ctx: StageContext) -> Any:
    ctx.progress("loading weights")
    time.sleep(float(ctx.args.get("load_s", 20.0)))
    ctx.progress("warming up")
    return create_echo(ctx)
