"""Property tests of ARScheduler over random traffic: joins, streamed input, steps, aborts, failed
steps, and preemption forced by a small KV cache.

Every step (via `ar_fakes.step`) checks the budget, the batch size, that page tables cover their
chunks, that no request writes a page another holds or a cached page, and that every page is
exactly one of free / held / evictable with refcounts matching the holders. At the end nothing is
held, and each request that finished produced what it produces alone with plenty of pages.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from hypothesis import event, given, settings
from hypothesis import strategies as st
from scheduling.ar_fakes import FakeRunner, check_pages, chunk, done, new, result, run_all, step

from voice_server.scheduling import ARScheduler, Emit, EmitKind
from voice_server.scheduling.contract import ARSpec

_VOCAB = 12
_PREFIXES = ([1, 2, 3, 4, 5, 6, 7, 8], [1, 2, 3, 4, 9, 9], [])


_OPS = ("step",) * 6 + ("add", "add", "input", "input", "abort", "abort_in_step", "fail")
"""Weighted: mostly steps, so requests get far enough to contend for pages."""


@dataclass
class Plan:
    rid: str
    prompt: list[int]
    sampling: dict[str, Any]
    chunks: list[list[int]] | None
    """Streamed input in pieces (None: whole prompt in NEW)."""


@st.composite
def plans(draw: st.DrawFn) -> list[Plan]:
    out = []
    for i in range(draw(st.integers(1, 6))):
        prefix = draw(st.sampled_from(_PREFIXES))
        tail = draw(st.lists(st.integers(0, _VOCAB - 1), min_size=0 if prefix else 1, max_size=4))
        prompt = prefix + tail
        sampling: dict[str, Any] = {"max_tokens": draw(st.integers(1, 8)), "ignore_eos": draw(st.booleans())}
        if draw(st.booleans()):
            sampling["stop"] = draw(st.lists(st.sampled_from(["<11>", "3><4", "5><5", "7>"]), max_size=2, unique=True))
        chunks = None
        if draw(st.booleans()):
            cuts = sorted(draw(st.lists(st.integers(0, len(prompt)), max_size=3)))
            bounds = [0, *cuts, len(prompt)]
            chunks = [prompt[a:b] for a, b in zip(bounds, bounds[1:])]
        out.append(Plan(f"r{i}", prompt, sampling, chunks))
    return out


def solo(plan: Plan) -> dict[str, Any]:
    spec = ARSpec(num_pages=64, page_size=4, max_model_len=64, eos_token_ids=(0,))
    sched = ARScheduler(spec, max_batch_size=1, max_step_tokens=64)
    sched.add(new(plan.rid, plan.prompt, **plan.sampling), 0.0)
    return result(run_all(sched, FakeRunner(spec, _VOCAB))[plan.rid])


@settings(max_examples=150, deadline=None)
@given(data=st.data(), plan_list=plans())
def test_random_traffic_keeps_pages_consistent_and_outputs_unchanged(data: st.DataObject,
                                                                     plan_list: list[Plan]) -> None:
    page_size = data.draw(st.integers(1, 4), label="page_size")
    # NOTE: every request fits alone (so none fails), but barely: they contend and get preempted.
    min_pages = -(-max(len(p.prompt) + p.sampling["max_tokens"] for p in plan_list) // page_size)
    spec = ARSpec(data.draw(st.integers(min_pages, min_pages + min_pages // 2), label="num_pages"), page_size, 64, (0,))
    sched = ARScheduler(spec, data.draw(st.integers(1, 6), label="max_batch_size"),
                        data.draw(st.integers(1, 12), label="max_step_tokens"), data.draw(st.booleans()))
    runner = FakeRunner(spec, _VOCAB)
    emits: dict[str, list[Emit]] = {p.rid: [] for p in plan_list}
    to_add = list(plan_list)
    open_input = {p.rid: list(p.chunks) for p in plan_list if p.chunks is not None}
    gone: set[str] = set()
    """Aborted, or failed by a step: no output to compare."""

    def collect(new_emits: list[Emit]) -> None:
        for emit in new_emits:
            assert emit.kind is not EmitKind.ERROR, emit.message
            emits[emit.request_id].append(emit)

    def add_next() -> None:
        plan = to_add.pop(0)
        sched.add(new(plan.rid, None if plan.chunks is not None else plan.prompt, is_stream=plan.chunks is not None,
                      **plan.sampling), 0.0)

    for _ in range(data.draw(st.integers(0, 80), label="num_ops")):
        op = data.draw(st.sampled_from(_OPS), label="op")
        if op == "add" and to_add:
            add_next()
        elif op == "input" and open_input:
            rid = data.draw(st.sampled_from(sorted(open_input)))
            if rid in sched.active_request_ids:
                _send_input(sched, open_input, rid)
        elif op == "abort" and sched.active_request_ids:
            rid = data.draw(st.sampled_from(sorted(sched.active_request_ids)))
            assert sched.abort(rid)
            gone.add(rid)
        elif op in ("abort_in_step", "fail"):
            batch = sched.schedule(0.0)
            if batch is None:
                continue
            if op == "fail":
                failed = sched.fail(batch, "boom")
                # NOTE: a batch of several runs each member alone first; only a lone step fails.
                expected = [s.request_id for s in batch.seqs] if len(batch.seqs) == 1 else []
                assert sorted(e.request_id for e in failed) == expected
                gone.update(e.request_id for e in failed)
            else:
                victim = data.draw(st.sampled_from([s.request_id for s in batch.seqs]))
                sched.abort(victim)
                gone.add(victim)
                collect(sched.update(batch, runner.execute(batch)))
        else:
            collect(step(sched, runner)[1])
        check_pages(sched)
    while to_add:
        add_next()
    for rid in sorted(open_input):
        while rid in open_input and rid in sched.active_request_ids:
            _send_input(sched, open_input, rid)
    for _ in range(10_000):
        batch, new_emits = step(sched, runner)
        collect(new_emits)
        if batch is None:
            break
    assert sched.active_request_ids == set()
    stats = sched.stats()
    assert stats["num_used_pages"] == 0 and stats["num_running"] == stats["num_waiting"] == 0
    assert stats["num_free_pages"] + stats["num_cached_pages"] == spec.num_pages
    assert all(sched.cache.refcount(p) == 0 for p in range(spec.num_pages))
    event(f"preempted: {stats['num_preemptions'] > 0}")
    event(f"prefix hit: {stats['num_prefix_hit_tokens'] > 0}")
    event(f"finished: {len(plan_list) - len(gone)} of {len(plan_list)}")
    for plan in plan_list:
        if plan.rid in gone:
            continue
        out = result(emits[plan.rid])
        assert out == {**solo(plan), "num_cached_tokens": out["num_cached_tokens"]}
        stream = emits[plan.rid][:-1]
        assert [t for e in stream for t in e.payload["token_ids"]] == out["token_ids"]
        assert "".join(e.payload["text"] for e in stream) == out["text"]


def _send_input(sched: ARScheduler, open_input: dict[str, list[list[int]]], rid: str) -> None:
    """The next piece of a streamed prompt, or DONE once all were sent."""
    pieces = open_input[rid]
    if pieces:
        sched.add(chunk(rid, pieces.pop(0)), 0.0)
    else:
        sched.add(done(rid), 0.0)
        del open_input[rid]


@settings(max_examples=150, deadline=None)
@given(
    prompts=st.lists(st.tuples(st.sampled_from(_PREFIXES), st.lists(st.integers(0, _VOCAB - 1), min_size=1, max_size=4),
                               st.integers(2, 8)), min_size=2, max_size=6),
    page_size=st.integers(1, 4), num_spare_pages=st.integers(0, 3), max_batch_size=st.integers(2, 6),
    max_step_tokens=st.integers(1, 16), is_prefix_cached=st.booleans(),
)
def test_contention_preempts_without_changing_outputs(
    prompts: list[tuple[list[int], list[int], int]], page_size: int, num_spare_pages: int, max_batch_size: int,
    max_step_tokens: int, is_prefix_cached: bool,
) -> None:
    plan_list = [Plan(f"r{i}", prefix + tail, {"max_tokens": n, "ignore_eos": True}, None)
                 for i, (prefix, tail, n) in enumerate(prompts)]
    num_pages = -(-max(len(p.prompt) + p.sampling["max_tokens"] for p in plan_list) // page_size) + num_spare_pages
    spec = ARSpec(num_pages, page_size, 64, (0,))
    sched = ARScheduler(spec, max_batch_size, max_step_tokens, is_prefix_cached)
    for plan in plan_list:
        sched.add(new(plan.rid, plan.prompt, **plan.sampling), 0.0)
    emits = run_all(sched, FakeRunner(spec, _VOCAB))
    event(f"preempted: {sched.num_preemptions > 0}")
    assert sched.stats()["num_used_pages"] == 0
    for plan in plan_list:
        assert result(emits[plan.rid])["token_ids"] == solo(plan)["token_ids"]
