"""Shared checks of the talker stage's engines (hibari: tests/engine/test_tts_stage.py and
tests/runners/test_tts_runner.py; piper: test_tts_piper_stage.py and test_tts_piper.py): in stage
processes, the LLM-like test stage (tests/text_stages.py) streams text deltas into the `talker`; in
this process, the runner takes the same items one batch at a time."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
from harness import Pipeline
from text_stages import text_deltas

from voice_server.config import PipelineConfig, StageConfig, pipeline_from_dict
from voice_server.engine.requests import TerminalOutput
from voice_server.engine.runtime import StageContext
from voice_server.runners.tts_runner import TTSRunner
from voice_server.scheduling import Emit, EmitKind, SimpleBatch, WorkItem, WorkKind


def talker_pipeline(name: str, **factory_args: Any) -> Pipeline:
    return Pipeline(pipeline_from_dict({
        "name": name,
        "stages": [
            {"name": "thinker", "factory": "text_stages:create_scripted_text", "scheduler": "ar",
             "terminal": True, "stream_to": ["talker"], "memory_fraction": 0.01, "max_batch_size": 4},
            {"name": "talker", "factory": "voice_server.stages.tts:create_tts", "terminal": True,
             "memory_fraction": 0.01, "max_batch_size": 4, "factory_args": {"num_threads": 1, **factory_args}},
        ],
    }))


def pcm_of(outputs: list[TerminalOutput], rate: int) -> np.ndarray:
    """The talker's audio of one reply, checked to be float32 mono chunks at `rate`."""
    talker = [o for o in outputs if o.stage == "talker" and not o.is_final]
    pieces = [o.payload["pcm"] for o in talker]
    assert pieces and all(isinstance(p, np.ndarray) and p.dtype == np.float32 and p.ndim == 1 for p in pieces)
    assert all(o.payload["sample_rate"] == rate for o in talker)
    return np.concatenate(pieces)


def gated_reply(tts: Pipeline, text: str, tmp_path: Path, held: list[str]) -> list[TerminalOutput]:
    """`text` through the pipeline, the thinker holding its stream open after the deltas `held` (the 4th
    to 6th) until the talker's first audio has reached the client: a talker that waited for the end of
    the text would leave the gate shut until its timeout, and its audio would come after the thinker's end."""
    assert text_deltas(text)[3:6] == held
    gate = tmp_path / "gate"
    params = {"gate_path": str(gate), "gate_after": 6, "gate_timeout_s": 20.0}

    async def go() -> list[TerminalOutput]:
        got = []
        async for out in tts.coordinator.submit({"text": text}, params):
            got.append(out)
            if out.stage == "talker":
                gate.touch()
        return got

    outputs = tts.run(go())
    order = [(o.stage, o.is_final) for o in outputs]
    assert order.index(("talker", False)) < order.index(("thinker", True))
    assert outputs[-1].is_final and {o.stage for o in outputs if o.is_final} == {"thinker", "talker"}
    assert next(o for o in outputs if o.stage == "thinker" and o.is_final).payload["text"] == text
    assert not any("text" in o.payload for o in outputs if o.stage == "talker")
    return outputs


# -- the runner in this process ----------------------------------------------------------------------

def stage_ctx(device: str = "cpu", phases: list[str] | None = None, **factory_args: Any) -> StageContext:
    stage = StageConfig("talker", "voice_server.stages.tts:create_tts", terminal=True, device=device,
                        factory_args=factory_args)
    report = phases.append if phases is not None else None
    return StageContext(stage, PipelineConfig(name="t", stages=(stage,)), None, "test", report)


def run(runner: TTSRunner, *items: WorkItem) -> list[Emit]:
    """Admit and execute each item in its own batch, as a stage with max_batch_size 1 would."""
    emits: list[Emit] = []
    for item in items:
        emits.extend(runner.execute(SimpleBatch((runner.admit(item),))).emits)
    return emits


def stream_items(rid: str, deltas: list[str]) -> list[WorkItem]:
    return [WorkItem(rid, WorkKind.NEW, is_stream=True),
            *(WorkItem(rid, WorkKind.CHUNK, {"token_ids": [i], "text": d}, seq=i) for i, d in enumerate(deltas)),
            WorkItem(rid, WorkKind.DONE, seq=len(deltas))]


def emitted_pcm(emits: list[Emit], rate: int) -> np.ndarray:
    pieces = [e.payload["pcm"] for e in emits if e.kind is EmitKind.STREAM]
    assert all(p.dtype == np.float32 and p.ndim == 1 and p.size for p in pieces)
    assert all(e.payload["sample_rate"] == rate for e in emits if e.kind is EmitKind.STREAM)
    return np.concatenate(pieces)
