"""Numeric test stages (numpy only): prove the engine before real models arrive.

    framer --stream--> transform --stream--> sink (terminal)

- framer: splits `payload["signal"]` (1-D float array) into frames of `frame_len` samples.
- transform: `frame * gain + offset` per chunk; honours `params["chunk_delay_ms"]` so tests can
  keep a request busy (abort, crash).
- sink: passes frames to the client with their index and sum.
Bad input (missing or malformed signal) becomes an ERROR for that request only.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np

from voice_server.engine.runtime import StageContext
from voice_server.scheduling import Emit, EmitKind, Runner, SimpleBatch, SimpleResult, WorkKind


class Framer(Runner[SimpleBatch, SimpleResult]):
    def __init__(self, frame_len: int) -> None:
        if not isinstance(frame_len, int) or frame_len < 1:
            raise ValueError("factory_args.frame_len must be an integer >= 1")
        self.frame_len = frame_len

    def execute(self, batch: SimpleBatch) -> SimpleResult:
        emits: list[Emit] = []
        for item in batch.items:
            if item.kind is not WorkKind.NEW:
                continue
            signal = item.payload.get("signal")
            if not isinstance(signal, np.ndarray) or signal.ndim != 1 or signal.dtype.kind != "f":
                emits.append(Emit(item.request_id, EmitKind.ERROR, message="payload.signal must be a 1-D float array"))
                continue
            num_frames = -(-len(signal) // self.frame_len)
            for index in range(num_frames):
                frame = signal[index * self.frame_len:(index + 1) * self.frame_len]
                emits.append(Emit(item.request_id, EmitKind.STREAM, {"frame": frame.copy(), "index": index}))
            emits.append(Emit(item.request_id, EmitKind.RESULT, {"num_frames": num_frames}))
        return SimpleResult(tuple(emits))



class ChunkMap(Runner[SimpleBatch, SimpleResult]):
    """Applies `fn` to every incoming chunk; emits RESULT with the chunk count at end of stream."""

    def __init__(self, fn: Any, delay_key: str = "chunk_delay_ms") -> None:
        self.fn = fn
        self.delay_key = delay_key
        self.num_seen: dict[str, int] = {}

    def execute(self, batch: SimpleBatch) -> SimpleResult:
        emits: list[Emit] = []
        for item in batch.items:
            rid = item.request_id
            if item.kind is WorkKind.NEW:
                self.num_seen[rid] = 0
            elif item.kind is WorkKind.CHUNK:
                if item.seq != self.num_seen.get(rid, 0):
                    emits.append(Emit(rid, EmitKind.ERROR, message=f"chunk {item.seq} out of order"))
                    continue
                self.num_seen[rid] = item.seq + 1
                delay_ms = float(item.params.get(self.delay_key, 0.0))
                if delay_ms > 0:
                    time.sleep(delay_ms / 1000.0)
                emits.append(Emit(rid, EmitKind.STREAM, self.fn(item.payload)))
            else:
                emits.append(Emit(rid, EmitKind.RESULT, {"num_frames": self.num_seen.get(rid, 0)}))
        return SimpleResult(tuple(emits))

    def release(self, request_id: str) -> None:
        self.num_seen.pop(request_id, None)


def create_framer(ctx: StageContext) -> Framer:
    return Framer(int(ctx.args.get("frame_len", 160)))


def create_transform(ctx: StageContext) -> ChunkMap:
    gain, offset = float(ctx.args.get("gain", 2.0)), float(ctx.args.get("offset", 1.0))
    return ChunkMap(lambda p: {"frame": p["frame"] * np.float32(gain) + np.float32(offset), "index": p["index"]})


def create_sink(ctx: StageContext) -> ChunkMap:
    return ChunkMap(
        lambda p: {"frame": p["frame"], "index": p["index"], "sum": float(np.sum(p["frame"], dtype=np.float64))},
        delay_key="sink_delay_ms",
    )


class Echo(Runner[SimpleBatch, SimpleResult]):
    """Returns each new request's payload as its result (relay round trips through the engine).
    A payload with `poison` set makes the whole batch raise, one with `emit_unencodable` emits an
    object msgpack cannot carry (failure isolation tests)."""

    def execute(self, batch: SimpleBatch) -> SimpleResult:
        items = batch.items
        if any(i.payload.get("poison") for i in items):
            raise ValueError("poisoned input")
        if any(i.payload.get("emit_unencodable") for i in items):
            return SimpleResult(tuple(Emit(i.request_id, EmitKind.RESULT, {"bad": object()}) for i in items))
        return SimpleResult(tuple(Emit(i.request_id, EmitKind.RESULT, dict(i.payload)) for i in items
                                  if i.kind is WorkKind.NEW))



def create_echo(ctx: StageContext) -> Echo:
    return Echo()
