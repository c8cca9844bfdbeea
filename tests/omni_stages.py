"""Test stages around the Qwen3-Omni stages, run in real stage processes.

- `create_recorder`: a terminal stage that reports what it received from the stage before it (every
  payload key as it arrived through the relay), standing in for the thinker behind the encoder.
- `create_code_streamer`: an upstream that streams codec frames (what the talker sends) into a
  `code2wav` stage, so the vocoder runs in a real pipeline. `code_frames(num_frames, seed)` gives the
  frames a request asks for, so a test can decode them whole and compare. `bad_chunk` makes one
  chunk's codes out of range (admission must refuse that request alone); `chunk_delay_ms` spaces
  the chunks.
"""

from __future__ import annotations

import time

import torch

from voice_server.engine.runtime import StageContext
from voice_server.models.qwen3_omni.presets import TINY_CODEBOOK, TINY_NUM_CODE_GROUPS
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


def code_frames(num_frames: int, seed: int) -> torch.Tensor:
    """[G, num_frames] codes of the tiny preset, the same in every process."""
    return torch.randint(0, TINY_CODEBOOK, (TINY_NUM_CODE_GROUPS, num_frames),
                         generator=torch.Generator().manual_seed(seed))


class CodeStreamer(Runner[SimpleBatch, SimpleResult]):
    """payload: `num_frames`, `seed`, `chunk_len` (frames per stream chunk, default 3), optional
    `bad_chunk` (index of a chunk sent out of range) and `chunk_delay_ms`."""

    def execute(self, batch: SimpleBatch) -> SimpleResult:
        emits = []
        for item in batch.items:
            p = item.payload
            codes = code_frames(int(p["num_frames"]), int(p["seed"]))
            size = int(p.get("chunk_len", 3))
            for index, start in enumerate(range(0, codes.shape[1], size)):
                time.sleep(float(p.get("chunk_delay_ms", 0)) / 1000.0)
                part = codes[:, start : start + size]
                if index == p.get("bad_chunk"):
                    part = part + TINY_CODEBOOK
                emits.append(Emit(item.request_id, EmitKind.STREAM, {"codes": part}))
            emits.append(Emit(item.request_id, EmitKind.RESULT, {}))
        return SimpleResult(tuple(emits))


def create_code_streamer(ctx: StageContext) -> CodeStreamer:
    return CodeStreamer()
