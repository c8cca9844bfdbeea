"""The asr stage in its own process, fed through the Coordinator: a user's turn streamed while they speak
(20 ms chunks), whole requests, refusals, aborts and the decoder pool, observed through stage stats."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
from harness import Pipeline, shm_segments
from speech_text import SENTENCES, chunks, speech, word_error_rate

from voice_server.config import ConfigError, pipeline_from_dict
from voice_server.engine.coordinator import Coordinator, OverloadError, RequestError, RequestStream
from voice_server.engine.runtime import StageContext
from voice_server.stages.asr import create_asr

HISTORY = [{"role": "user", "content": "hello"}, {"role": "assistant", "content": "Hi, how can I help?"}]
MAX_STREAMS = 2
MAX_WER = 0.35


def asr_config(**factory_args: Any) -> dict[str, Any]:
    return {"name": "asr", "stages": [{"name": "asr", "factory": "voice_server.stages.asr:create_asr",
                                       "terminal": True, "memory_fraction": 0.05,
                                       "factory_args": {"max_streams": MAX_STREAMS, **factory_args}}]}


@pytest.fixture(scope="module")
def asr() -> Iterator[Pipeline]:
    pipeline = Pipeline(pipeline_from_dict(asr_config(max_audio_seconds=20)))
    yield pipeline
    pipeline.close()
    assert shm_segments(pipeline.coordinator.launch_id) == []


async def stream_turn(stream: RequestStream, audio: np.ndarray) -> tuple[list[str], Any]:
    """Send `audio` in 20 ms chunks, end the turn once a partial transcript came back, return the
    partials and the final output."""
    assert stream.input is not None
    for piece in chunks(audio, 20):
        assert stream.input.send({"audio": piece})
    first = await stream.__anext__()  # NOTE: the turn is still open: this can only be a partial
    stream.input.end()
    outputs = [first] + [o async for o in stream]
    assert all(o.stage == "asr" for o in outputs) and [o.is_final for o in outputs][-1]
    partials = [o.payload["input_transcript_partial"] for o in outputs[:-1]]
    return partials, outputs[-1]


async def wait_free_decoders(coordinator: Coordinator, timeout_s: float = 10.0) -> dict[str, Any]:
    """The asr stage's stats once it holds no request and every decoder is back in its pool."""
    deadline = time.monotonic() + timeout_s
    while True:
        reply = (await coordinator.stats())["asr"]
        counters = reply.counters["asr"]
        if reply.active["asr"] == [] and counters["num_free_decoders"] == MAX_STREAMS and reply.num_live_slots == 0:
            return counters
        assert time.monotonic() < deadline, reply
        await asyncio.sleep(0.01)


def test_a_streamed_turn_gives_partials_before_its_end_then_the_transcript(asr: Pipeline) -> None:
    text = SENTENCES[0]

    async def scenario() -> tuple[list[str], Any]:
        return await stream_turn(asr.coordinator.submit({"messages": HISTORY}, stream_input=True), speech(text))

    partials, final = asr.run(scenario())
    assert partials and all(isinstance(p, str) for p in partials)
    transcript = final.payload["input_transcript"]
    print(f"partials: {partials}; final: {transcript!r}")
    assert word_error_rate(text, transcript) <= MAX_WER, transcript
    assert final.payload["messages"] == [*HISTORY, {"role": "user", "content": transcript}]
    counters = asr.run(wait_free_decoders(asr.coordinator))
    print(f"asr counters: {counters}")
    assert counters["end_utt_us_max"] > 0


def test_a_whole_request_is_transcribed(asr: Pipeline) -> None:
    text = SENTENCES[1]
    outputs = asr.collect({"messages": [*HISTORY, {"role": "user", "audio": speech(text)}]})
    [result] = outputs
    assert result.is_final and word_error_rate(text, result.payload["input_transcript"]) <= MAX_WER
    assert result.payload["messages"] == [*HISTORY, {"role": "user", "content": result.payload["input_transcript"]}]


def test_a_malformed_chunk_fails_its_turn_alone_while_another_turn_completes(asr: Pipeline) -> None:
    text = SENTENCES[2]

    async def scenario() -> tuple[str, tuple[list[str], Any]]:
        good = asr.coordinator.submit({"messages": []}, stream_input=True)
        bad = asr.coordinator.submit({"messages": []}, stream_input=True)
        assert good.input is not None and bad.input is not None
        bad.input.send({"audio": np.zeros(320, np.float32)})
        bad.input.send({"audio": np.zeros(320, np.float64)})
        refused = r"stage 'asr': refused: payload.audio: must be 1-D int16 or float32"
        with pytest.raises(RequestError, match=refused) as info:
            [o async for o in bad]
        assert not isinstance(info.value, OverloadError)
        assert not bad.input.send({"audio": np.zeros(320, np.float32)})  # the turn is over: nothing is sent
        return str(info.value), await stream_turn(good, speech(text))

    _, (partials, final) = asr.run(scenario())
    assert partials and word_error_rate(text, final.payload["input_transcript"]) <= MAX_WER
    asr.run(wait_free_decoders(asr.coordinator))


def test_abort_mid_turn_returns_the_decoder_and_a_turn_over_a_full_pool_waits_for_it(asr: Pipeline) -> None:
    audio = speech(SENTENCES[0])

    async def asr_counters(**want: int) -> dict[str, Any]:
        deadline = time.monotonic() + 10
        while True:
            counters = (await asr.coordinator.stats())["asr"].counters["asr"]
            if all(counters[k] == v for k, v in want.items()):
                return counters
            assert time.monotonic() < deadline, counters
            await asyncio.sleep(0.01)

    async def scenario() -> dict[str, int]:
        streams = [asr.coordinator.submit({"messages": []}, stream_input=True) for _ in range(MAX_STREAMS)]
        for stream in streams:
            assert stream.input is not None
            for piece in chunks(audio[:len(audio) // 2], 20):
                stream.input.send({"audio": piece})
            await stream.__anext__()  # a partial: the stage holds this turn's decoder now
        busy = await asr_counters(num_free_decoders=0, num_requests=MAX_STREAMS)
        # NOTE: one more turn is not refused: it waits, its audio kept, while the pool is lent out.
        waiting = asr.coordinator.submit({"messages": []}, stream_input=True)
        assert waiting.input is not None
        pieces = chunks(audio, 20)
        for piece in pieces[:len(pieces) // 2]:
            waiting.input.send({"audio": piece})
        await asr_counters(num_waiting=1, num_waits=busy["num_waits"] + 1)
        await streams[0].aclose()  # NOTE: aborted mid-turn: its decoder goes back to the pool...
        await asr_counters(num_free_decoders=1)
        for piece in pieces[len(pieces) // 2:]:  # ...and the waiting turn takes it at its next chunk
            waiting.input.send({"audio": piece})
        waiting.input.end()
        outputs = [o async for o in waiting]
        assert outputs[-1].is_final
        waited.append(outputs[-1].payload["input_transcript"])
        for stream in streams[1:]:
            await stream.aclose()
        return await wait_free_decoders(asr.coordinator)

    waited: list[str] = []
    counters = asr.run(scenario())
    assert counters["num_requests"] == 0 and counters["num_waiting"] == 0 and counters["num_grown"] == 0
    assert word_error_rate(SENTENCES[0], waited[0]) <= MAX_WER
    # The decoders given back mid-turn serve the next turns as fresh ones.
    text = SENTENCES[1]

    async def again() -> tuple[list[str], Any]:
        return await stream_turn(asr.coordinator.submit({"messages": []}, stream_input=True), speech(text))

    assert word_error_rate(text, asr.run(again())[1].payload["input_transcript"]) <= MAX_WER


@pytest.mark.parametrize(("factory_args", "field", "match"), [
    ({"max_streams": 0}, "factory_args.max_streams", r"integer in \[1, 1024\]"),
    ({"max_streams": True}, "factory_args.max_streams", r"integer in \[1, 1024\]"),
    ({"max_audio_seconds": -1}, "factory_args.max_audio_seconds", "a number > 0"),
    ({"fwdflat": "yes"}, "factory_args.fwdflat", "true or false"),
    ({"max_hmms_per_frame": 50}, "factory_args.max_hmms_per_frame", r"integer in \[100, 1000000\]"),
    ({"beam": 1e-48}, "factory_args.beam", "unknown key"),
    ({"narrowband_streams": -1}, "factory_args.narrowband_streams", r"integer in \[0, 1024\]"),
    ({"engine": "whisper", "narrowband_streams": 2}, "factory_args.narrowband_streams",
     "only for engine pocketsphinx"),
])
def test_bad_factory_args_name_the_field(factory_args: dict[str, Any], field: str, match: str) -> None:
    cfg = pipeline_from_dict(asr_config(**factory_args))
    ctx = StageContext(cfg.stages[0], cfg, None, "test")
    with pytest.raises(ConfigError, match=rf"stage 'asr': field '{field}': .*{match}"):
        create_asr(ctx)


def test_the_conversation_goes_to_the_next_stage_and_not_back_to_the_client() -> None:
    raw = asr_config()
    raw["stages"][0]["next"] = "thinker"
    raw["stages"].append({"name": "thinker", "factory": "text_stages:create_scripted_text", "scheduler": "ar",
                          "terminal": True, "memory_fraction": 0.01})
    pipeline = Pipeline(pipeline_from_dict(raw))
    text = SENTENCES[1]
    try:
        async def scenario() -> list[Any]:
            stream = pipeline.coordinator.submit({"messages": HISTORY}, stream_input=True)
            assert stream.input is not None
            for piece in chunks(speech(text), 100):
                stream.input.send({"audio": piece})
            stream.input.end()
            return [o async for o in stream]

        outputs = pipeline.run(scenario())
    finally:
        pipeline.close()
    [final] = [o for o in outputs if o.stage == "asr" and o.is_final]
    transcript = final.payload["input_transcript"]
    assert "messages" not in final.payload and word_error_rate(text, transcript) <= MAX_WER
    # NOTE: the scripted thinker says the last user message it got: the transcript, via `messages`.
    [reply] = [o for o in outputs if o.stage == "thinker" and o.is_final]
    assert reply.payload["text"].strip() == transcript.strip()
