"""The `ar` scheduler in a real stage process, with a model-free runner (tests/ar_stages.py):
streaming tokens, admission refusals, failure isolation, aborts and page accounting through stats."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from typing import Any

import pytest
from ar_stages import POISON, expected_tokens
from harness import Pipeline, shm_segments

from voice_server.config import pipeline_from_dict
from voice_server.engine.coordinator import RequestError

NUM_PAGES = 64


@pytest.fixture(scope="module")
def ar() -> Iterator[Pipeline]:
    cfg = pipeline_from_dict({
        "name": "fake-ar",
        "stages": [{
            "name": "llm", "factory": "ar_stages:create_fake_ar", "scheduler": "ar", "terminal": True,
            "memory_fraction": 0.01, "max_batch_size": 8, "max_step_tokens": 32,
            "factory_args": {"num_pages": NUM_PAGES, "page_size": 4, "step_delay_ms": 2},
        }],
    })
    pipeline = Pipeline(cfg)
    yield pipeline
    pipeline.close()
    assert shm_segments(pipeline.coordinator.launch_id) == []


def counters(ar: Pipeline) -> dict[str, int]:
    return ar.run(ar.coordinator.stats())["llm"].counters["llm"]


def wait_idle(ar: Pipeline, timeout_s: float = 5.0) -> dict[str, int]:
    deadline = time.monotonic() + timeout_s
    while True:
        stats = counters(ar)
        if (stats["num_used_pages"] == 0 and stats["num_running"] == 0) or time.monotonic() > deadline:
            return stats
        time.sleep(0.02)


def tokens_of(outputs: list[Any]) -> list[int]:
    return [t for o in outputs if not o.is_final for t in o.payload["token_ids"]]


def submit_all(ar: Pipeline, requests: list[tuple[list[int], dict[str, Any]]], stagger_s: float = 0.0) -> list[Any]:
    async def one(i: int, prompt: list[int], params: dict[str, Any]) -> Any:
        await asyncio.sleep(i * stagger_s)
        try:
            return [o async for o in ar.coordinator.submit({"token_ids": prompt}, params)]
        except RequestError as exc:
            return exc

    async def go() -> list[Any]:
        return await asyncio.gather(*(one(i, p, q) for i, (p, q) in enumerate(requests)))

    return ar.run(go())


def test_streams_one_token_per_step_and_a_final_result(ar: Pipeline) -> None:
    prompt = [5, 6, 7, 8, 9, 10, 11]
    outputs = ar.collect({"token_ids": prompt}, {"sampling": {"max_tokens": 6}})
    want = expected_tokens(prompt, 6)
    assert tokens_of(outputs) == want
    final = outputs[-1]
    assert final.is_final and final.payload["token_ids"] == want
    assert final.payload["finish_reason"] == "length"
    assert final.payload["text"] == "".join(f" w{t}" for t in want)
    assert wait_idle(ar)["num_used_pages"] == 0


def test_concurrent_staggered_requests_each_get_their_own_tokens(ar: Pipeline) -> None:
    requests = [([3 + i] * (2 + 3 * i), {"sampling": {"max_tokens": 5 + i}}) for i in range(8)]
    results = submit_all(ar, requests, stagger_s=0.01)
    for (prompt, params), outputs in zip(requests, results):
        assert tokens_of(outputs) == expected_tokens(prompt, params["sampling"]["max_tokens"])
    assert wait_idle(ar)["num_used_pages"] == 0


@pytest.mark.parametrize(("payload", "params", "needle"), [
    ({"token_ids": "abc"}, {}, "payload.token_ids"),
    ({"token_ids": [1, 2]}, {"sampling": {"temperature": -1}}, "params.sampling.temperature"),
    ({"token_ids": [1, 2]}, {"sampling": {"max_tokenz": 3}}, "unknown field(s) max_tokenz"),
    ({"token_ids": [2] * (NUM_PAGES * 4 + 1)}, {}, "prompt"),
])
def test_malformed_requests_are_refused_alone(ar: Pipeline, payload: Any, params: Any, needle: str) -> None:
    good = ([4, 5, 6], {"sampling": {"max_tokens": 20}})

    async def go() -> tuple[Any, Any]:
        async def bad() -> Any:
            await asyncio.sleep(0.01)
            try:
                return [o async for o in ar.coordinator.submit(payload, params)]
            except RequestError as exc:
                return exc

        async def fine() -> Any:
            return [o async for o in ar.coordinator.submit({"token_ids": good[0]}, good[1])]

        return await asyncio.gather(bad(), fine())

    refused, served = ar.run(go())
    assert isinstance(refused, RequestError) and needle in str(refused)
    assert tokens_of(served) == expected_tokens(good[0], 20)
    assert wait_idle(ar)["num_used_pages"] == 0


def test_a_runner_raising_at_admission_fails_that_request_and_the_stage_keeps_serving(ar: Pipeline) -> None:
    # NOTE: not a refusal (ValueError) but a runner's bug, as a tensor left on the wrong device was on an
    # H200: the request must end with an error, not hang while the message is dropped.
    async def go() -> tuple[Any, Any]:
        async def broken() -> Any:
            try:
                return [o async for o in ar.coordinator.submit({"token_ids": [4, 5], "raise_at_admit": True}, {})]
            except RequestError as exc:
                return exc

        async def fine() -> Any:
            return [o async for o in ar.coordinator.submit({"token_ids": [4, 5, 6]}, {"sampling": {"max_tokens": 5}})]

        return await asyncio.wait_for(asyncio.gather(broken(), fine()), 30)

    failed, served = ar.run(go())
    assert isinstance(failed, RequestError) and "admission failed: RuntimeError: admission bug" in str(failed)
    assert tokens_of(served) == expected_tokens([4, 5, 6], 5)
    assert wait_idle(ar)["num_used_pages"] == 0


def test_a_raising_step_fails_only_the_culprit_and_the_stage_keeps_serving(ar: Pipeline) -> None:
    requests = [([10 + i, 11, 12], {"sampling": {"max_tokens": 30}}) for i in range(4)]
    requests.insert(2, ([7, POISON, 8], {"sampling": {"max_tokens": 30}}))
    results = submit_all(ar, requests, stagger_s=0.01)
    assert isinstance(results[2], RequestError) and "poisoned step" in str(results[2])
    for i, ((prompt, _), outputs) in enumerate(zip(requests, results)):
        if i != 2:
            assert tokens_of(outputs) == expected_tokens(prompt, 30)
    stats = wait_idle(ar)
    assert stats["num_used_pages"] == 0 and stats["num_running"] == 0 and stats["num_waiting"] == 0
    assert tokens_of(ar.collect({"token_ids": [3, 4]}, {"sampling": {"max_tokens": 3}})) == expected_tokens([3, 4], 3)


def test_abort_mid_decode_frees_every_page(ar: Pipeline) -> None:
    baseline = wait_idle(ar)
    prompt = list(range(2, 40))

    async def go() -> list[Any]:
        stream = ar.coordinator.submit({"token_ids": prompt}, {"sampling": {"max_tokens": 200}})
        got = []
        async for out in stream:
            got.append(out)
            if len(got) == 5:
                mid = await ar.coordinator.stats()
                assert mid["llm"].counters["llm"]["num_used_pages"] >= len(prompt) // 4
                await ar.coordinator.abort(stream.request_id)
        return got

    got = ar.run(go())
    assert 5 <= len(got) < 200
    after = wait_idle(ar)
    assert after["num_used_pages"] == baseline["num_used_pages"] == 0
    assert after["num_free_pages"] + after["num_cached_pages"] == NUM_PAGES


def test_stop_strings_and_stop_tokens_end_a_request(ar: Pipeline) -> None:
    prompt = [20, 21, 22]
    want = expected_tokens(prompt, 10)
    outputs = ar.collect({"token_ids": prompt}, {"sampling": {"max_tokens": 10, "stop_token_ids": [want[3]]}})
    assert tokens_of(outputs) == want[:4] and outputs[-1].payload["finish_reason"] == "stop"
    stop = f" w{want[5]}"
    outputs = ar.collect({"token_ids": prompt}, {"sampling": {"max_tokens": 10, "stop": [stop]}})
    assert outputs[-1].payload["finish_reason"] == "stop"
    assert outputs[-1].payload["text"] == "".join(f" w{t}" for t in want[:5])
    assert "".join(o.payload["text"] for o in outputs[:-1]) == outputs[-1].payload["text"]


def test_streaming_input_from_an_upstream_stage_prefills_as_it_arrives() -> None:
    cfg = pipeline_from_dict({
        "name": "fake-ar-streamed",
        "stages": [
            {"name": "chunker", "factory": "ar_stages:create_token_chunker", "stream_to": ["llm"],
             "memory_fraction": 0.01},
            {"name": "llm", "factory": "ar_stages:create_fake_ar", "scheduler": "ar", "terminal": True,
             "memory_fraction": 0.01, "max_batch_size": 4, "max_step_tokens": 4,
             "factory_args": {"num_pages": 32, "page_size": 4}},
        ],
    })
    pipeline = Pipeline(cfg)
    try:
        prompt = list(range(2, 25))
        outputs = pipeline.collect({"token_ids": prompt, "chunk_len": 5, "chunk_delay_ms": 5},
                                   {"sampling": {"max_tokens": 6}})
        assert tokens_of(outputs) == expected_tokens(prompt, 6)
        assert outputs[-1].payload["num_prompt_tokens"] == len(prompt)
        # NOTE: an upstream stream with no tokens at all is refused, not left waiting forever.
        with pytest.raises(RequestError, match="no prompt tokens"):
            pipeline.collect({"token_ids": []})
    finally:
        pipeline.close()
    assert shm_segments(pipeline.coordinator.launch_id) == []
