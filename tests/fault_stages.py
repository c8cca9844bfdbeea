"""Stage factories for fault tests, importable in spawned stage processes (tests/ is on sys.path)."""

from __future__ import annotations

import os

import numpy as np

from voice_server.engine.runtime import StageContext
from voice_server.scheduling import Emit, EmitKind, Runner, SimpleBatch, SimpleResult
from voice_server.stages.numeric import ChunkMap, Echo


def create_flaky_echo(ctx: StageContext) -> Echo:
    """An echo stage that crashes while loading whenever the file `crash_if_exists` exists."""
    if os.path.exists(ctx.args["crash_if_exists"]):
        os._exit(3)
    return Echo()


class Amplifier(Runner[SimpleBatch, SimpleResult]):
    """Emits `payload["num_chunks"]` float32 frames of `payload["chunk_bytes"]` bytes per request, shaped
    like the numeric framer's, so a numeric sink can follow it (relay load)."""

    def execute(self, batch: SimpleBatch) -> SimpleResult:
        emits = []
        for item in batch.items:
            num, size = int(item.payload["num_chunks"]), int(item.payload["chunk_bytes"])
            for i in range(num):
                frame = np.full(size // 4, i, np.float32)
                emits.append(Emit(item.request_id, EmitKind.STREAM, {"frame": frame, "index": i}))
            emits.append(Emit(item.request_id, EmitKind.RESULT, {"num_chunks": num}))
        return SimpleResult(tuple(emits))


def create_amplifier(ctx: StageContext) -> Amplifier:
    return Amplifier()


def create_pid_tagger(ctx: StageContext) -> ChunkMap:
    """Tags every chunk with the pid of the process that handled it (which replica served a request);
    honours `params["chunk_delay_ms"]` like the numeric transform."""
    return ChunkMap(lambda p: {"index": p["index"], "pid": os.getpid()})
