"""A request's output queue coalesces audio for a consumer that lags, and nothing else."""

from __future__ import annotations

import asyncio

import numpy as np

from voice_server.engine.request_table import RequestTable
from voice_server.engine.requests import TerminalOutput


def audio(stage: str, start: int, num: int, rate: int = 24000) -> TerminalOutput:
    pcm = np.arange(start, start + num, dtype=np.float32)
    return TerminalOutput("r", stage, {"pcm": pcm, "sample_rate": rate}, False, {"submit": 1.0, stage: 2.0 + start})


def test_unread_audio_chunks_join_in_order_and_text_and_finals_stay_apart() -> None:
    async def scenario() -> list[TerminalOutput]:
        table = RequestTable(asyncio.get_running_loop(), ("tts", "llm"), lambda ids: None, max_queued_outputs=6)
        stream = table.open("r", None)
        # NOTE: eight audio chunks with nobody reading: one queued output, far under the bound of 6.
        for i in range(8):
            assert table.deliver(audio("tts", 10 * i, 10))
        assert table.deliver(TerminalOutput("r", "llm", {"text": "hi"}, False))
        assert table.deliver(audio("tts", 80, 5))
        assert table.deliver(audio("tts", 85, 5, rate=16000))  # NOTE: another rate: its own chunk
        assert table.deliver(TerminalOutput("r", "llm", {"text": ""}, True))
        assert table.deliver(TerminalOutput("r", "tts", {"pcm": np.zeros(3, np.float32), "sample_rate": 24000}, True))
        return [output async for output in stream]

    outputs = asyncio.run(scenario())
    assert [o.stage for o in outputs] == ["tts", "llm", "tts", "tts", "llm", "tts"]
    np.testing.assert_array_equal(outputs[0].payload["pcm"], np.arange(80, dtype=np.float32))
    assert outputs[0].timings == {"submit": 1.0, "tts": 2.0}  # NOTE: the first chunk's stamps
    assert outputs[1].payload == {"text": "hi"}
    assert outputs[2].payload["pcm"].size == 5 and outputs[3].payload["sample_rate"] == 16000
    assert outputs[5].is_final and outputs[5].payload["pcm"].size == 3


def test_a_consumer_that_keeps_up_gets_every_chunk_as_sent() -> None:
    async def scenario() -> list[int]:
        table = RequestTable(asyncio.get_running_loop(), ("tts",), lambda ids: None)
        stream = table.open("r", None)
        sizes = []
        for i in range(5):
            table.deliver(audio("tts", i, 7))
            sizes.append((await stream.__anext__()).payload["pcm"].size)
        table.deliver(TerminalOutput("r", "tts", {}, True))
        return sizes + [len([o async for o in stream])]

    assert asyncio.run(scenario()) == [7, 7, 7, 7, 7, 1]
