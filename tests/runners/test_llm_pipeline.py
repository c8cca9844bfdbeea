"""SmolLM2-135M behind the `ar` scheduler in a real stage process (configs like llm-cpu.yaml):
batch invariance across staggered concurrent conversations, prefix-cache hits, aborts that free
every page, and streamed text that adds up to the final text."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from typing import Any

import pytest
from harness import Pipeline, shm_segments

from voice_server.config import pipeline_from_dict

QUESTIONS = [
    "What is the capital of France?",
    "Give me one tip for sleeping better.",
    "Write a haiku about the sea.",
    "Name three primary colours, and explain briefly how painters mix them into others.",
    "Why is the sky blue? Answer in one sentence.",
    "Name a famous painter.",
    "What is 12 times 7?",
    "Tell me something interesting about octopuses and how they see the world around them.",
]
NUM_TOKENS = 12


@pytest.fixture(scope="module")
def llm() -> Iterator[Pipeline]:
    cfg = pipeline_from_dict({
        "name": "llm-test",
        "stages": [{
            "name": "thinker", "factory": "voice_server.stages.llm:create_llm", "scheduler": "ar",
            "terminal": True, "memory_fraction": 0.08, "max_batch_size": 8,
            # NOTE: a small step budget splits prompts into different chunks alone and in a crowd.
            "max_step_tokens": 48,
            "factory_args": {"model": "smollm2", "dtype": "fp32", "quantization": "none", "page_size": 16,
                             "max_model_len": 2048, "sampling": {"temperature": 0.0, "max_tokens": NUM_TOKENS}},
        }],
    })
    pipeline = Pipeline(cfg)
    yield pipeline
    pipeline.close()
    assert shm_segments(pipeline.coordinator.launch_id) == []


def ask(question: str, system: str | None = None) -> dict[str, Any]:
    messages = [{"role": "system", "content": system}] if system else []
    return {"messages": [*messages, {"role": "user", "content": question}]}


def collect(llm: Pipeline, payloads: list[dict[str, Any]], stagger_s: float = 0.0) -> list[list[Any]]:
    async def one(i: int, payload: dict[str, Any]) -> list[Any]:
        await asyncio.sleep(i * stagger_s)
        return [o async for o in llm.coordinator.submit(payload)]

    async def go() -> list[list[Any]]:
        return await asyncio.gather(*(one(i, p) for i, p in enumerate(payloads)))

    return llm.run(go(), timeout=300)


def counters(llm: Pipeline) -> dict[str, int]:
    return llm.run(llm.coordinator.stats())["thinker"].counters["thinker"]


def wait_idle(llm: Pipeline) -> dict[str, int]:
    deadline = time.monotonic() + 10
    while (stats := counters(llm))["num_running"] or stats["num_used_pages"]:
        assert time.monotonic() < deadline, stats
        time.sleep(0.05)
    return stats


@pytest.mark.environment
def test_staggered_conversations_give_the_same_greedy_ids_as_each_alone_where_the_blas_allows(llm: Pipeline) -> None:
    """fp32 rows are batch invariant only where the runner's probe found a padding for this CPU's BLAS
    (every x86 one measured so far); elsewhere it batches anyway and says so in its stats."""
    if not counters(llm)["batch_invariant"]:
        pytest.skip("environment: this CPU's BLAS has no batch-invariant padding for SmolLM2's fp32 linears "
                    "(the thinker's stats say batch_invariant 0)")
    payloads = [ask(q) for q in QUESTIONS]
    alone = [collect(llm, [p])[0] for p in payloads]
    crowd = collect(llm, payloads, stagger_s=0.15)
    for question, solo, crowded in zip(QUESTIONS, alone, crowd):
        assert solo[-1].payload["token_ids"] == crowded[-1].payload["token_ids"], question
        assert len(solo[-1].payload["token_ids"]) == NUM_TOKENS or solo[-1].payload["finish_reason"] == "stop"
        # NOTE: streamed deltas add up to the final text; the final result repeats the ids.
        assert "".join(o.payload["text"] for o in crowded[:-1]) == crowded[-1].payload["text"]
        assert [t for o in crowded[:-1] for t in o.payload["token_ids"]] == crowded[-1].payload["token_ids"]
    assert any(c[-1].payload["text"].strip() for c in crowd)
    assert wait_idle(llm)["num_used_pages"] == 0


def test_a_prefix_cache_hit_gives_the_same_ids_as_a_cold_run(llm: Pipeline) -> None:
    system = "You are Pim, a terse assistant for a lighthouse keeper on a remote island. " * 4
    cold = collect(llm, [ask("How do I trim a lamp wick?", system)])[0][-1].payload
    before = counters(llm)
    warm = collect(llm, [ask("How do I trim a lamp wick?", system)])[0][-1].payload
    other = collect(llm, [ask("When is high tide?", system)])[0][-1].payload
    after = counters(llm)
    assert cold["num_cached_tokens"] == 0
    assert warm["num_cached_tokens"] >= 64 and warm["token_ids"] == cold["token_ids"]
    assert other["num_cached_tokens"] >= 64  # NOTE: the shared system prompt, prefilled once
    assert after["num_prefix_hit_tokens"] - before["num_prefix_hit_tokens"] >= 128


def test_abort_mid_decode_frees_every_page(llm: Pipeline) -> None:
    baseline = wait_idle(llm)

    async def go() -> int:
        stream = llm.coordinator.submit(ask("Tell me a long story about a dragon."),
                                        {"sampling": {"max_tokens": 400}})
        num = 0
        async for _ in stream:
            num += 1
            if num == 3:
                held = (await llm.coordinator.stats())["thinker"].counters["thinker"]
                assert held["num_used_pages"] >= 2 and held["num_running"] == 1
                await llm.coordinator.abort(stream.request_id)
        return num

    assert 3 <= llm.run(go(), timeout=120) < 400
    after = wait_idle(llm)
    assert after["num_used_pages"] == baseline["num_used_pages"] == 0
    assert after["num_free_pages"] + after["num_evictable_pages"] == after["num_pages"]


def test_a_malformed_request_is_refused_alone(llm: Pipeline) -> None:
    from voice_server.engine.coordinator import RequestError

    async def bad() -> str:
        try:
            [o async for o in llm.coordinator.submit({"messages": [{"role": "user"}]})]
        except RequestError as exc:
            return str(exc)
        return ""

    assert "messages" in llm.run(bad())
    assert collect(llm, [ask("Name a famous painter.")])[0][-1].payload["token_ids"]
