"""DecoderRunner on a tiny dummy Llama: paged attention against the contiguous cache, batch
invariance, KV sizing, admission and the stage factory's argument checks."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch
from ar_batches import Request, run
from reference_greedy import greedy_contiguous
from tiny_llama import tiny_llama

from voice_server.config import PipelineConfig, StageConfig
from voice_server.config.errors import ConfigError
from voice_server.engine.local import LocalOutcome, LocalRequest, LocalStage
from voice_server.engine.runtime import StageContext
from voice_server.models.llama import load_llama
from voice_server.models.paged import PagedKVCache, build_attention_context, decode_kernel_usable
from voice_server.models.quant import quantize_linear
from voice_server.runners import DecoderRunner, DecoderRunnerConfig
from voice_server.runners.detok import Detokenizer
from voice_server.runners.row_plan import probe_counts, probe_row_plan
from voice_server.runners.sizing import plan_kv_cache
from voice_server.scheduling import AdmissionError, ARScheduler, WorkItem, WorkKind
from voice_server.scheduling.contract import ARBatch, ARSeq, SamplingParams
from voice_server.stages.llm import create_llm

torch.set_num_threads(1)

CFG = tiny_llama(vocab_size=256, hidden_size=64, intermediate_size=128, head_dim=16, max_position_embeddings=512)
MIB = 1 << 20


@pytest.fixture(scope="module")
def model() -> Any:
    return load_llama(load_format="dummy", config=CFG, seed=1)


@pytest.fixture(scope="module")
def runner(model: Any) -> DecoderRunner:
    return DecoderRunner(model, None, DecoderRunnerConfig(budget_bytes=120 * MIB, page_size=4, max_step_tokens=64))


def _prompts(num: int, seed: int = 0) -> dict[str, list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return {f"r{i}": torch.randint(4, CFG.vocab_size, (3 + 9 * i,), generator=gen).tolist() for i in range(num)}


@torch.inference_mode()
def test_paged_forward_equals_contiguous(model: Any) -> None:
    """Two sequences (a prefill chunk after cached tokens, a decode token) against the KVCache path."""
    cache = PagedKVCache(CFG.num_hidden_layers, 16, 4, CFG.num_key_value_heads, CFG.head_dim, torch.float32)
    ids = _prompts(2)
    a, b = ids["r0"] + ids["r1"][:6], ids["r1"]
    pages_a, pages_b = [9, 2, 5], [0, 15, 7, 1]
    # Step 1: a without its last 2 tokens, b without its last; step 2: a 2-token chunk and a decode.
    first = [(0, len(a) - 2, pages_a), (0, len(b) - 1, pages_b)]
    ctx, pos = build_attention_context(cache, first, len(a) + len(b) - 3)
    model.forward_paged(torch.tensor(a[:-2] + b[:-1]), pos, ctx, torch.tensor([0]))
    second = [(len(a) - 2, 2, pages_a), (len(b) - 1, 1, pages_b)]
    ctx, pos = build_attention_context(cache, second, 4)
    logits = model.forward_paged(torch.tensor(a[-2:] + b[-1:] + [0]), pos, ctx, torch.tensor([0, 1, 2]))
    for rows, seq in ((slice(0, 2), a), (slice(2, 3), b)):
        ref = model(torch.tensor([seq]), torch.arange(len(seq))[None], model.make_kv_cache())[0]
        n = rows.stop - rows.start
        torch.testing.assert_close(logits[rows], ref[-n:], atol=1e-5, rtol=1e-5)


def test_greedy_matches_generate_greedy_batched_and_chunked(model: Any, runner: DecoderRunner) -> None:
    prompts = _prompts(6)
    ref = {rid: greedy_contiguous(model, p, 10) for rid, p in prompts.items()}
    requests = {rid: Request(p, max_new_tokens=10, start_step=i) for i, (rid, p) in enumerate(prompts.items())}
    out = run(runner, requests)
    assert {rid: r.output for rid, r in out.items()} == ref
    chunked = run(runner, {"r5": Request(prompts["r5"], max_new_tokens=10, chunk_sizes=(1, 7, 13))})
    assert chunked["r5"].output == ref["r5"]


def test_compiled_decode_step_gives_the_same_greedy_ids(model: Any) -> None:
    """`compile`: single-stream decode steps through the AOTInductor graph, prefill and batches eager."""
    # NOTE: not batch invariant, so that single-stream steps are one row (the compiled path).
    config = DecoderRunnerConfig(budget_bytes=120 * MIB, page_size=4, max_step_tokens=64, is_batch_invariant=False)
    eager = DecoderRunner(model, None, config)
    compiled = DecoderRunner(model, None, dataclasses.replace(config, compile=True))
    step = compiled.decode_step
    assert step is not None
    calls = []
    graph = step.compiled
    step.compiled = lambda *args: calls.append(1) or graph(*args)
    prompts = _prompts(3)
    for rid, prompt in prompts.items():
        # NOTE: one request at a time: its decode steps are one row each.
        requests = {rid: Request(prompt, max_new_tokens=12)}
        assert run(compiled, requests)[rid].output == run(eager, requests)[rid].output
    assert len(calls) == 3 * 11
    requests = {rid: Request(p, max_new_tokens=6, start_step=i) for i, (rid, p) in enumerate(prompts.items())}
    assert {r: o.output for r, o in run(compiled, requests).items()} == {
        r: o.output for r, o in run(eager, requests).items()
    }


@pytest.mark.environment
def test_logits_are_batch_invariant_where_the_blas_allows(model: Any, runner: DecoderRunner) -> None:
    """The same decode step alone and next to other sequences: bit-identical logits. Depends on the CPU's
    BLAS: where no padding makes fp32 rows independent of the count, the runner says so and batches anyway
    (tests/runners/test_row_plan.py covers that case everywhere)."""
    if not runner.is_batch_invariant:
        pytest.skip(f"environment: this CPU's BLAS ({torch.backends.cpu.get_cpu_capability()}) has no "
                    "batch-invariant padding for these fp32 linears; the runner warned and batches as rows come")
    prompts = _prompts(8, seed=3)
    out = run(runner, {rid: Request(p, max_new_tokens=1) for rid, p in prompts.items()})
    captured: list[torch.Tensor] = []
    original = model.forward_paged

    def spy(*args: Any) -> torch.Tensor:
        captured.append(original(*args))
        return captured[-1]

    model.forward_paged = spy
    try:
        seqs = []
        page = 0
        for rid, p in prompts.items():
            tokens = p + out[rid].output
            num_pages = -(-len(tokens) // 4)
            # Recompute the prompt (prefill) then a decode token, alone and batched.
            seqs.append((rid, tokens, tuple(range(page, page + num_pages))))
            page += num_pages

        def step(chosen: list[Any]) -> list[torch.Tensor]:
            sp = SamplingParams()
            runner.execute(ARBatch(tuple(ARSeq(r, tuple(t[:-1]), 0, pg, False, sp) for r, t, pg in chosen)))
            captured.clear()
            runner.execute(ARBatch(tuple(ARSeq(r, (t[-1],), len(t) - 1, pg, True, sp) for r, t, pg in chosen)))
            return list(captured[-1])

        batched = step(seqs)
        for i in (0, 3, 7):
            assert torch.equal(step([seqs[i]])[0], batched[i]), i
    finally:
        del model.forward_paged


def test_kv_sizing_from_budget(model: Any, runner: DecoderRunner) -> None:
    plan = runner.plan
    per_page = PagedKVCache.bytes_per_page(2, 4, 2, 16, torch.float32)
    assert per_page == 2 * 2 * 4 * 2 * 16 * 4
    assert plan.num_pages == (120 * MIB - plan.weight_bytes - plan.reserve_bytes) // per_page - 1
    assert runner.ar_spec.num_pages == plan.num_pages and runner.ar_spec.page_size == 4
    assert runner.ar_spec.max_model_len == 512 and runner.ar_spec.eos_token_ids == (3,)
    assert runner.cache.kv.shape == (2, 2, plan.num_pages + 1, 4, 2, 16)
    small = plan_kv_cache(
        budget_bytes=10_000, weight_bytes=1000, reserve_bytes=1000, bytes_per_page=1000, page_size=4, max_model_len=512
    )
    assert (small.num_pages, small.max_model_len) == (7, 28)  # the cache caps max_model_len
    with pytest.raises(ValueError, match="raise memory_fraction"):
        DecoderRunner(model, None, DecoderRunnerConfig(budget_bytes=MIB))


def test_kv_cache_dtype_policy(model: Any) -> None:
    """fp16 where w4a8's fused layers run (twice the pages of an fp32 cache in the same budget), the
    residual stream's elsewhere; the same greedy ids as a contiguous reference either way here."""
    w4a8 = load_llama(load_format="dummy", config=CFG, seed=2, quantization="w4a8")
    budget = 120 * MIB
    half = DecoderRunner(w4a8, None, DecoderRunnerConfig(budget_bytes=budget, page_size=4))
    full = DecoderRunner(w4a8, None, DecoderRunnerConfig(budget_bytes=budget, page_size=4, kv_cache_dtype="model"))
    # NOTE: the fused layers need AVX-512 (and the kernels): an AVX2-only CPU keeps the residual dtype.
    is_fused = decode_kernel_usable(torch.float16, "cpu") and w4a8.fused_layers() is not None
    assert half.cache.kv.dtype == (torch.float16 if is_fused else torch.float32)
    assert full.cache.kv.dtype == torch.float32
    if is_fused:
        assert half.plan.num_pages + 1 == 2 * (full.plan.num_pages + 1)
    else:
        with pytest.raises(ValueError, match="kv_cache_dtype: fp16 needs the fused"):
            DecoderRunner(w4a8, None, DecoderRunnerConfig(budget_bytes=budget, kv_cache_dtype="fp16"))
    prompt = [5, 9, 11, 2, 30]
    outputs = [run(r, {"a": Request(prompt, max_new_tokens=8)})["a"].output for r in (half, full)]
    assert outputs[0] == outputs[1] == greedy_contiguous(w4a8, prompt, 8)
    assert DecoderRunner(model, None, DecoderRunnerConfig(budget_bytes=budget)).cache.kv.dtype == torch.float32
    with pytest.raises(ValueError, match="kv_cache_dtype: fp16 needs the fused"):
        DecoderRunner(model, None, DecoderRunnerConfig(budget_bytes=budget, kv_cache_dtype="fp16"))
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of"):
        DecoderRunnerConfig(budget_bytes=budget, kv_cache_dtype="bf16")


@pytest.mark.parametrize("kind", ["fp32", "int8", "int4"])
def test_row_plan_is_found(kind: str) -> None:
    """The probe's plan holds on rows it never saw: every step size up to 40, any row in it."""
    linear = torch.nn.Linear(64, 192, bias=False)
    module = linear if kind == "fp32" else quantize_linear(linear, kind)
    plan, broken = probe_row_plan([module], torch.float32, 40)
    if not plan.is_batch_invariant:
        pytest.fail(f"no batch-invariant row plan for {broken} on {torch.backends.cpu.get_cpu_capability()}")
    x = torch.randn(48, 64)
    with torch.no_grad():
        ref = module(x)
        for n in probe_counts(40):
            rows = plan.num_rows(n)
            assert torch.equal(module(x[:rows]), ref[:rows]), (plan, n)


def test_execute_refuses_bad_batches(runner: DecoderRunner) -> None:
    sp = SamplingParams()
    with pytest.raises(ValueError, match="do not cover"):
        runner.execute(ARBatch((ARSeq("a", (1, 2, 3, 4, 5), 0, (0,), True, sp),)))
    with pytest.raises(ValueError, match="page id outside"):
        runner.execute(ARBatch((ARSeq("a", (1,), 0, (runner.ar_spec.num_pages,), True, sp),)))
    with pytest.raises(ValueError, match="outside"):
        runner.execute(ARBatch((ARSeq("a", (1,), 512, tuple(range(129)), True, sp),)))


class FeedingRunner(DecoderRunner):
    """Streams data with each sampled token, as the thinker feeds its talker, and has none for a request
    named `unfed*`: a step that samples one raises after it sampled (and, in batch order, decoded and
    fed) its other sequences, as a feed out of device memory would."""

    def _output_data(self, seq: ARSeq, token: int) -> dict[str, Any]:
        if seq.request_id.startswith("unfed"):
            raise RuntimeError(f"no feed for {seq.request_id}")
        return {"feed": token}


def _serve(model: Any, request: LocalRequest, unfed_steps: tuple[int, ...]) -> LocalOutcome:
    """`request` under the AR scheduler (the stage's loop), with an `unfed*` request joining at each step
    in `unfed_steps`, on a fresh runner (the same seed stream every time)."""
    config = DecoderRunnerConfig(budget_bytes=120 * MIB, page_size=4, max_step_tokens=64, sampler_seed=5)
    runner = FeedingRunner(model, None, config)
    # NOTE: one byte per token: characters span tokens, so the detokenizer holds pending bytes.
    runner.detok = Detokenizer([bytes([i]) for i in range(CFG.vocab_size)])
    stage = LocalStage(ARScheduler(runner.ar_spec, max_batch_size=4, max_step_tokens=64), runner)
    unfed = [LocalRequest(f"unfed{i}", {"token_ids": [9, 8, 7]}, {"sampling": {"temperature": 1.0}}, arrival_step=at)
             for i, at in enumerate(unfed_steps)]
    outcomes = stage.run([*unfed, request])
    for other in unfed:
        assert outcomes[other.request_id].error == f"RuntimeError: no feed for {other.request_id}"
    return outcomes[request.request_id]


@pytest.mark.parametrize("sampling", [{"temperature": 1.0, "seed": 7}, {"temperature": 0.9, "top_k": 50}, {}],
                         ids=["seeded", "unseeded", "greedy"])
def test_a_request_rerun_after_a_step_failed_midway_streams_what_it_streams_undisturbed(
    model: Any, sampling: dict[str, Any]
) -> None:
    """Steps that raise after sampling are rerun member by member (the scheduler's policy); the sampler's
    generators, its seed stream and the detokenizer's pending bytes move only for steps that succeeded,
    so the rerun request streams exactly the tokens and text of a run where nothing failed."""
    prompt = _prompts(1, seed=4)["r0"]
    request = LocalRequest("r", {"token_ids": prompt}, {"sampling": {**sampling, "max_tokens": 16}})
    undisturbed = _serve(model, request, ())
    # NOTE: at step 0 the unfed request is first in the batch (it fails before `r` is decoded); later
    # ones come after `r`'s decode token (they fail after `r` was sampled, decoded and fed). The last
    # fails the step that decodes `r`'s greedy token 200, a UTF-8 lead byte held pending.
    disturbed = _serve(model, request, (0, 4, 9, 16))
    assert undisturbed.error is None and disturbed.error is None
    assert len(undisturbed.emits) == 17
    assert [(e.kind, e.payload) for e in disturbed.emits] == [(e.kind, e.payload) for e in undisturbed.emits]


def _new(payload: Any, params: Any = None, **kw: Any) -> WorkItem:
    return WorkItem("r", WorkKind.NEW, payload, params if params is not None else {}, **kw)


def test_admission(runner: DecoderRunner) -> None:
    item = runner.admit(_new({"token_ids": [5, 6, 7]}, {"sampling": {"temperature": 0.5}, "other": 1}))
    assert item.payload == {"token_ids": [5, 6, 7]}
    assert item.params["other"] == 1 and item.params["sampling"]["temperature"] == 0.5
    assert SamplingParams.from_params(item.params).temperature == 0.5
    assert runner.admit(_new({}, is_stream=True)).payload == {"token_ids": []}
    chunk = runner.admit(WorkItem("r", WorkKind.CHUNK, {"token_ids": [9]}, seq=0))
    assert chunk.payload == {"token_ids": [9]}
    bad = [
        (_new({}), "exactly one of"),
        (_new({"token_ids": [1], "prompt": "x"}), "exactly one of"),
        (_new({"token_ids": [1], "extra": 2}), "unknown field"),
        (_new({"token_ids": "12"}), "payload.token_ids: must be a list"),
        (_new({"token_ids": [1, 256]}), "payload.token_ids: 256 is not a token id"),
        (_new({"token_ids": [1, True]}), "payload.token_ids: True"),
        (_new({"token_ids": []}), "gives no tokens"),
        (_new({"token_ids": [1] * 512}), "payload.token_ids: 512 tokens"),
        (_new({"prompt": "hi"}), "payload.prompt: this stage has no tokenizer"),
        (_new({"prompt": 3}), "payload.prompt: must be a string"),
        (_new({"messages": {}}), "payload.messages: must be a list"),
        (_new({"messages": [{"role": "bot", "content": "x"}]}), r"payload.messages\[0\].role"),
        (_new({"messages": [{"role": "user", "content": 1}]}), r"payload.messages\[0\].content"),
        (_new({"token_ids": [1]}, {"sampling": {"temprature": 1}}), "params.sampling: unknown field"),
        (_new({"token_ids": [1]}, {"sampling": {"top_p": 0}}), "params.sampling.top_p"),
        (WorkItem("r", WorkKind.CHUNK, {"words": "x"}), "chunk payload: needs exactly one of"),
    ]
    for work, message in bad:
        with pytest.raises(AdmissionError, match=message):
            runner.admit(work)


def _ctx(args: dict[str, Any], budget: int = 2 << 30) -> StageContext:
    stage = StageConfig(
        name="thinker", factory="voice_server.stages.llm:create_llm", scheduler="ar", terminal=True, factory_args=args
    )
    return StageContext(stage, PipelineConfig(name="t", stages=(stage,)), budget, "test")


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ({"modle": "smollm2"}, "field 'factory_args.modle': unknown key"),
        ({"quantization": "int3"}, "factory_args.quantization.*must be one of"),
        ({"dtype": "fp16"}, "factory_args.dtype"),
        ({"page_size": 0}, "factory_args.page_size"),
        ({"num_threads": 0}, "factory_args.num_threads"),
        ({"compile": "yes"}, "factory_args.compile"),
        ({"kv_cache_dtype": "fp8"}, "factory_args.kv_cache_dtype.*must be one of"),
        ({"quantization": "int4", "kv_cache_dtype": "fp16"}, "kv_cache_dtype: fp16 needs the fused C"),
        ({"sampling": {"top_k": -1}}, "factory_args.sampling.*top_k"),
        ({"model": "/nonexistent"}, "factory_args.model"),
    ],
)
def test_factory_refuses_bad_args(args: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        create_llm(_ctx(args))
