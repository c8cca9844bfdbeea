"""The text-to-speech stage in real stage processes, fed the way the default pipeline feeds it: an
LLM-like `ar` stage (tests/text_stages.py, terminal, like the thinker) streams text deltas through
`stream_to` into the `talker` (terminal). Speech comes out as 24 kHz PCM that pocketsphinx reads
back as the text, its first clause before the text stream has ended, and concurrent replies each
get exactly the audio of their own text. As the entry stage it speaks whole texts, and a malformed
one fails only its own request."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from harness import Pipeline, shm_segments
from speech_text import transcribe, word_error_rate
from talker_checks import gated_reply, talker_pipeline
from talker_checks import pcm_of as talker_pcm

from voice_server.config import pipeline_from_dict
from voice_server.engine.coordinator import RequestError
from voice_server.engine.requests import TerminalOutput
from voice_server.runners.synthesizers import HIBARI_RATE as SAMPLE_RATE
from voice_server.runners.tts_runner import TTSRunner
from voice_server.scheduling import EmitKind, SimpleBatch, WorkItem, WorkKind
from voice_server.stages.tts_engines import load_hibari

TEXTS = [
    "Hello there, how are you today? I hope the weather is nice where you are.",
    "The quick brown fox jumps over the lazy dog.",
    "Thank you for calling. Your order will arrive on Monday morning.",
]


@pytest.fixture(scope="module")
def tts() -> Iterator[Pipeline]:
    pipeline = talker_pipeline("tts")
    yield pipeline
    pipeline.close()
    assert shm_segments(pipeline.coordinator.launch_id) == []


def pcm_of(outputs: list[TerminalOutput]) -> np.ndarray:
    return talker_pcm(outputs, SAMPLE_RATE)


def test_first_audio_arrives_before_the_text_stream_ends(tts: Pipeline, tmp_path: Path) -> None:
    text = TEXTS[0]
    # NOTE: "Hello there," is complete at delta 3 (" how"): its audio opens the gate.
    outputs = gated_reply(tts, text, tmp_path, held=[" how", " are", " you"])
    talker_result = next(o for o in outputs if o.stage == "talker" and o.is_final).payload
    pcm = pcm_of(outputs)
    assert talker_result == {"num_samples": pcm.size, "num_clauses": 3}
    assert word_error_rate(text, transcribe(pcm, SAMPLE_RATE)) <= 0.35


def test_concurrent_replies_each_get_the_audio_of_their_own_text(tts: Pipeline) -> None:
    async def one(text: str) -> list[TerminalOutput]:
        return [o async for o in tts.coordinator.submit({"text": text})]

    async def go() -> list[list[TerminalOutput]]:
        return await asyncio.gather(*(one(t) for t in TEXTS))

    reference = TTSRunner(load_hibari("test", num_threads=1))
    for text, outputs in zip(TEXTS, tts.run(go())):
        pcm = pcm_of(outputs)
        # NOTE: each request has its own seeded noise generator: stage output = an in-process synthesis.
        assert np.array_equal(pcm, speak(reference, text))
        assert word_error_rate(text, transcribe(pcm, SAMPLE_RATE)) <= 0.35, text


def test_as_entry_stage_it_speaks_whole_texts_and_refuses_bad_ones_alone() -> None:
    pipeline = Pipeline(pipeline_from_dict({"name": "tts-entry", "stages": [
        {"name": "talker", "factory": "voice_server.stages.tts:create_tts", "terminal": True,
         "memory_fraction": 0.01, "factory_args": {"max_text_chars": 1000}},
    ]}))
    try:
        for payload, needle in (({"text": 42}, "payload.text: must be a string"),
                                ({"text": "x" * 1001}, "max_text_chars"), ({"prompt": "hi"}, "payload.text: missing")):
            with pytest.raises(RequestError, match=needle):
                pipeline.collect(payload)
        outputs = pipeline.collect({"text": TEXTS[1]})
        assert [o.is_final for o in outputs][-1] and outputs[-1].payload["num_samples"] == pcm_of(outputs).size
        assert word_error_rate(TEXTS[1], transcribe(pcm_of(outputs), SAMPLE_RATE)) <= 0.35
    finally:
        pipeline.close()
    assert shm_segments(pipeline.coordinator.launch_id) == []


def speak(runner: TTSRunner, text: str) -> Any:
    emits = runner.execute(SimpleBatch((runner.admit(WorkItem("ref", WorkKind.NEW, {"text": text})),))).emits
    runner.release("ref")
    return np.concatenate([e.payload["pcm"] for e in emits if e.kind is EmitKind.STREAM])
