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
from talker_checks import gated_reply, talker_pipeline  # noqa: E402
from talker_checks import pcm_of as talker_pcm  # noqa: E402

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
    pipeline = talker_pipeline("tts-piper", engine="piper")
    yield pipeline
    pipeline.close()
    assert shm_segments(pipeline.coordinator.launch_id) == []


def pcm_of(outputs: list[TerminalOutput]) -> np.ndarray:
    return talker_pcm(outputs, PIPER_RATE)


def test_first_audio_arrives_before_the_text_stream_ends(tts: Pipeline, tmp_path: Path) -> None:
    text = TEXTS[0]
    # NOTE: "Good morning," is complete at delta 3 (" I"): its audio opens the gate.
    outputs = gated_reply(tts, text, tmp_path, held=[" I", " would", " like"])
    pcm = pcm_of(outputs)
    assert next(o for o in outputs if o.stage == "talker" and o.is_final).payload == {
        "num_samples": pcm.size, "num_clauses": 2}
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
