"""A stage factory that ignores SIGTERM while it loads for `factory_args.load_s` seconds (default 20): a
stand-in for a load in native code that does not stop on SIGTERM, so stopping its launch waits for the
SIGKILL after the launcher's grace. Imported by the stage process as `stubborn_factory` (the tests put
this directory on PYTHONPATH)."""

from __future__ import annotations

import signal
import time
from typing import Any

from voice_server.engine.runtime import StageContext
from voice_server.stages.numeric import create_echo


def create(ctx: StageContext) -> Any:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    ctx.progress("loading weights")
    time.sleep(float(ctx.args.get("load_s", 20.0)))
    return create_echo(ctx)
