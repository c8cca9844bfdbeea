"""The talker stage with the opt-in Piper engine (the `piper` extra) in real stage processes, fed the
way `configs/default-piper.yaml` feeds it: an LLM-like `ar` stage (tests/text_stages.py, terminal,
like the thinker) streams text deltas through `stream_to` into the `talker`. Speech comes out as
22.05 kHz PCM that pocketsphinx reads back as the text, its first clause before the text stream has
ended, and concurrent replies each get the audio of their own text."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("piper", reason="the `piper` extra: pip install -e '.[dev,piper]'")

from harness import Pipeline, shm_segments  # noqa: E402
from speech_text import transcribe, word_error_rate  # noqa: E402
from text_stages import text_deltas  # noqa: E402

from voice_server.config import pipeline_from_dict  # noqa: E402
from voice_server.engine.requests import TerminalOutput  # noqa: E402
from voice_server.runners.synthesizers import PIPER_RATE  # noqa: E402

# NOTE: sentences pocketsphinx reads back clearly from this voice (see tests/runners/test_tts_piper.py):
# piper's noise varies from one synthesis to the next, so a marginal sentence would make a flaky test.
TEXTS = [
    "Good morning, I would like to book a table for two people tonight.",
    "The quick brown fox jumps over the lazy dog.",
    "I would like to book a table for two people tonight. What time does the train leave for New York City?",
]


@pytest.fixture(scope="module")
def tts() -> Iterator[Pipeline]:
    cfg = pipeline_from_dict({
        "name": "tts-piper",
        "stages": [
            {"name": "thinker", "factory": "text_stages:create_scripted_text", "scheduler": "ar",
             "terminal": True, "stream_to": ["talker"], "memory_fraction": 0.01, "max_batch_size": 4},
            {"name": "talker", "factory": "voice_server.stages.tts:create_tts", "terminal": True,
             "memory_fraction": 0.01, "max_batch_size": 4, "factory_args": {"engine": "piper", "num_threads": 1}},
        ],
    })
    pipeline = Pipeline(cfg)
    yield pipeline
    pipeline.close()
    assert shm_segments(pipeline.coordinator.launch_id) == []


def pcm_of(outputs: list[TerminalOutput]) -> np.ndarray:
    talker = [o for o in outputs if o.stage == "talker" and not o.is_final]
    pieces = [o.payload["pcm"] for o in talker]
    assert pieces and all(isinstance(p, np.ndarray) and p.dtype == np.float32 and p.ndim == 1 for p in pieces)
    assert all(o.payload["sample_rate"] == PIPER_RATE for o in talker)
    return np.concatenate(pieces)


def test_first_audio_arrives_before_the_text_stream_ends(tts: Pipeline, tmp_path: Path) -> None:
    text = TEXTS[0]
    gate = tmp_path / "gate"
    # NOTE: the thinker holds its stream open after " like" (delta 5) until the test has heard audio,
    # which "Good morning," (complete at delta 3, " I") allows; a talker that waited for the end of
    # the text would leave the gate shut until its timeout and fail the ordering check below.
    assert text_deltas(text)[3:6] == [" I", " would", " like"]
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
    pcm = pcm_of(outputs)
    assert next(o for o in outputs if o.stage == "talker" and o.is_final).payload == {
        "num_samples": pcm.size, "num_clauses": 2}
    assert not any("text" in o.payload for o in outputs if o.stage == "talker")
    assert word_error_rate(text, transcribe(pcm, PIPER_RATE)) <= 0.35


def test_concurrent_replies_each_get_the_audio_of_their_own_text(tts: Pipeline) -> None:
    async def one(text: str) -> list[TerminalOutput]:
        return [o async for o in tts.coordinator.submit({"text": text})]

    async def go() -> list[list[TerminalOutput]]:
        return await asyncio.gather(*(one(t) for t in TEXTS))

    for text, outputs in zip(TEXTS, tts.run(go())):
        pcm = pcm_of(outputs)
        # NOTE: piper's audio is not sample-reproducible (its model draws its own noise), so each
        # reply is checked by what it says: its own text, read back.
        assert next(o for o in outputs if o.stage == "talker" and o.is_final).payload["num_samples"] == pcm.size
        assert word_error_rate(text, transcribe(pcm, PIPER_RATE)) <= 0.35, text
