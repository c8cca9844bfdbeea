"""ARScheduler with a fake runner: batching, chunked prefill, streaming input, stops, pages."""

from __future__ import annotations

from typing import Any

import pytest
from scheduling.ar_fakes import FakeRunner, check_pages, chunk, done, new, result, run_all, step

from voice_server.config import StageConfig
from voice_server.scheduling import SCHEDULER_BUILDERS, ARScheduler, EmitKind, Runner, WorkItem, WorkKind
from voice_server.scheduling.contract import ARBatch, ARResult, ARSpec


def make(num_pages: int = 64, page_size: int = 4, max_model_len: int = 256, eos: tuple[int, ...] = (),
         max_batch_size: int = 8, max_step_tokens: int = 64, prefix_cache: bool = True,
         ) -> tuple[ARScheduler, FakeRunner]:
    spec = ARSpec(num_pages, page_size, max_model_len, eos)
    return ARScheduler(spec, max_batch_size, max_step_tokens, prefix_cache), FakeRunner(spec)


def shape(batch: ARBatch | None) -> list[tuple[str, int, int, bool]]:
    assert batch is not None
    return [(s.request_id, s.start_pos, len(s.token_ids), s.is_sampling) for s in batch.seqs]


def test_chunked_prefill_catches_up_under_the_budget_then_decodes() -> None:
    sched, runner = make(max_step_tokens=8)
    sched.add(new("a", list(range(1, 21)), max_tokens=3), 0.0)
    shapes = []
    while (batch := step(sched, runner)[0]) is not None:
        shapes += shape(batch)
    assert shapes == [("a", 0, 8, False), ("a", 8, 8, False), ("a", 16, 4, True), ("a", 20, 1, True),
                      ("a", 21, 1, True)]
    assert sched.stats()["num_used_pages"] == 0


def test_decode_goes_first_then_prefill_chunks_fcfs_cut_to_the_budget() -> None:
    sched, runner = make(max_step_tokens=8)
    sched.add(new("a", [1, 2, 3]), 0.0)
    step(sched, runner)
    sched.add(new("b", list(range(30))), 0.0)
    sched.add(new("c", list(range(30))), 0.0)
    batch, _ = step(sched, runner)
    assert shape(batch) == [("a", 3, 1, True), ("b", 0, 7, False)]
    batch, _ = step(sched, runner)
    assert shape(batch) == [("a", 4, 1, True), ("b", 7, 7, False)]


def test_admission_is_fcfs_up_to_max_batch_size() -> None:
    sched, runner = make(max_batch_size=2)
    for rid in "abc":
        sched.add(new(rid, [1, 2], max_tokens=2), 0.0)
    batch, _ = step(sched, runner)
    assert batch is not None and [s.request_id for s in batch.seqs] == ["a", "b"]
    assert sched.stats()["num_waiting"] == 1
    step(sched, runner)  # a and b finish
    batch, _ = step(sched, runner)
    assert batch is not None and [s.request_id for s in batch.seqs] == ["c"]


def test_streaming_input_prefills_what_it_knows_and_samples_after_done() -> None:
    sched, runner = make()
    sched.add(new("s", [1, 2, 3], is_stream=True, max_tokens=3), 0.0)
    assert shape(step(sched, runner)[0]) == [("s", 0, 2, False)]  # the last known token waits
    assert sched.schedule(0.0) is None and sched.next_wakeup(0.0) is None
    sched.add(chunk("s", [4, 5]), 0.0)
    assert sched.next_wakeup(0.0) == 0.0
    assert shape(step(sched, runner)[0]) == [("s", 2, 2, False)]
    sched.add(chunk("s", []), 0.0)
    sched.add(done("s"), 0.0)
    batch, emits = step(sched, runner)
    assert shape(batch) == [("s", 4, 1, True)]
    streamed = result(emits + run_all(sched, runner)["s"])
    alone, solo_runner = make()
    alone.add(new("s", [1, 2, 3, 4, 5], max_tokens=3), 0.0)
    assert streamed == result(run_all(alone, solo_runner)["s"])
    assert streamed["num_prompt_tokens"] == 5


def test_stream_emits_per_token_and_a_result_with_stop_string_held_back() -> None:
    sched, runner = make()
    runner.forced["a"] = [1, 7, 2, 3]
    sched.add(new("a", [5, 6], stop=["<7><2", "<9>"]), 0.0)
    emits = run_all(sched, runner)["a"]
    assert [(e.kind, e.payload.get("token_ids"), e.payload.get("text")) for e in emits] == [
        (EmitKind.STREAM, [1], "<1>"),
        (EmitKind.STREAM, [7], ""),  # "<7>" could start "<7><2"
        (EmitKind.STREAM, [2], ""),
        (EmitKind.RESULT, [1, 7, 2], "<1>"),
    ]
    assert emits[-1].payload["finish_reason"] == "stop"


@pytest.mark.parametrize(("sampling", "tokens", "text", "reason"), [
    ({}, [4, 0], "<4>", "stop"),  # EOS is returned as a token, not as text
    ({"ignore_eos": True, "max_tokens": 3}, [4, 0, 5], "<4><0><5>", "length"),
    ({"stop_token_ids": [4]}, [3, 4], "<3>", "stop"),
    ({"max_tokens": 2}, [3, 5], "<3><5>", "length"),
])
def test_stop_tokens_and_max_tokens(sampling: dict[str, Any], tokens: list[int], text: str, reason: str) -> None:
    sched, runner = make(eos=(0,))
    runner.forced["a"] = list(tokens) + [6, 6, 6]
    sched.add(new("a", [5, 6], **sampling), 0.0)
    out = result(run_all(sched, runner)["a"])
    assert (out["token_ids"], out["text"], out["finish_reason"]) == (tokens, text, reason)


def test_max_model_len_ends_the_request() -> None:
    sched, runner = make(max_model_len=6)
    sched.add(new("a", [1, 2, 3, 4], max_tokens=100), 0.0)
    out = result(run_all(sched, runner)["a"])
    assert len(out["token_ids"]) == 2 and out["finish_reason"] == "length"


def test_abort_frees_pages_at_once_and_drops_the_step_output() -> None:
    sched, runner = make(max_step_tokens=4)
    sched.add(new("a", list(range(10))), 0.0)
    sched.add(new("b", list(range(10))), 0.0)
    step(sched, runner)
    assert sched.stats()["num_used_pages"] == 1
    assert sched.abort("a") and sched.abort("b") and not sched.abort("a")
    check_pages(sched)
    assert sched.stats()["num_used_pages"] == 0 and sched.active_request_ids == set()
    sched.add(new("c", [1, 2, 3]), 0.0)
    batch = sched.schedule(0.0)
    assert batch is not None
    sched.abort("c")  # while the batch runs
    assert sched.update(batch, runner.execute(batch)) == []
    check_pages(sched)


def test_fail_errors_only_the_batch_members_and_frees_their_pages() -> None:
    sched, runner = make(max_batch_size=1)
    sched.add(new("a", [1, 2, 3]), 0.0)
    sched.add(new("b", [1, 2, 3]), 0.0)
    batch = sched.schedule(0.0)
    assert batch is not None
    emits = sched.fail(batch, "boom")
    assert [(e.request_id, e.kind, e.message) for e in emits] == [("a", EmitKind.ERROR, "boom")]
    check_pages(sched)
    assert sched.active_request_ids == {"b"}
    assert result(run_all(sched, runner)["b"])["finish_reason"] == "length"


def test_a_failed_batch_runs_each_member_alone_and_fails_only_the_culprit() -> None:
    sched, runner = make(max_step_tokens=64)
    for rid in "abc":
        sched.add(new(rid, [1, 2, 3], max_tokens=4), 0.0)
    batch = sched.schedule(0.0)
    assert batch is not None and len(batch.seqs) == 3
    assert sched.fail(batch, "boom") == []  # nobody fails yet: each runs alone first
    solos = []
    for _ in range(3):
        solo = sched.schedule(0.0)
        assert solo is not None and len(solo.seqs) == 1
        solos.append(solo.seqs[0].request_id)
        if solo.seqs[0].request_id == "b":
            emits = sched.fail(solo, "boom")
            assert [(e.request_id, e.kind) for e in emits] == [("b", EmitKind.ERROR)]
        else:
            sched.update(solo, runner.execute(solo))
    assert solos == ["a", "b", "c"]
    check_pages(sched)
    outcomes = run_all(sched, runner)
    assert set(outcomes) == {"a", "c"} and all(result(o)["finish_reason"] == "length" for o in outcomes.values())
    assert sched.stats()["num_used_pages"] == 0


def test_a_prefix_hit_skips_cached_full_pages() -> None:
    prompt = list(range(100, 117))  # 4 full pages of 4 + 1
    sched, runner = make()
    sched.add(new("a", prompt, max_tokens=1), 0.0)
    first = result(run_all(sched, runner)["a"])
    computed_alone = runner.num_computed_tokens
    assert first["num_cached_tokens"] == 0 and sched.stats()["num_cached_pages"] == 4
    sched.add(new("b", prompt, max_tokens=1), 0.0)
    second = result(run_all(sched, runner)["b"])
    assert second["num_cached_tokens"] == 16 and second["token_ids"] == first["token_ids"]
    assert runner.num_computed_tokens - computed_alone == 1
    assert sched.stats()["num_prefix_hit_tokens"] == 16 and sched.stats()["num_prefix_query_tokens"] == 34
    off, off_runner = make(prefix_cache=False)
    for rid in "ab":
        off.add(new(rid, prompt, max_tokens=1), 0.0)
        run_all(off, off_runner)
    assert off_runner.num_computed_tokens == 34 and off.stats()["num_cached_pages"] == 0


def test_a_running_request_commits_pages_a_later_one_hits() -> None:
    sched, runner = make(max_step_tokens=8)
    prompt = list(range(12))
    sched.add(new("a", prompt + [50], max_tokens=5), 0.0)
    step(sched, runner)  # a has 8 tokens (2 full pages) computed
    sched.add(new("b", prompt + [60]), 0.0)
    batch, _ = step(sched, runner)
    assert shape(batch) == [("a", 8, 5, True), ("b", 8, 3, False)]  # b's first 8 tokens were a hit
    tables = sched.page_tables()
    assert tables["a"][:2] == tables["b"][:2]


def test_lru_eviction_makes_room_for_a_new_prompt() -> None:
    sched, runner = make(num_pages=4, page_size=2)
    sched.add(new("a", [1, 2, 3, 4, 5], max_tokens=1), 0.0)
    run_all(sched, runner)
    assert sched.stats()["num_cached_pages"] == 2
    sched.add(new("b", [7, 8, 9, 10, 11, 12, 13], max_tokens=1), 0.0)
    assert result(run_all(sched, runner)["b"])["finish_reason"] == "length"
    check_pages(sched)
    assert sched.stats()["num_cached_pages"] == 3 and sched.cache.match([1, 2, 3]) == []


def test_preemption_recomputes_and_gives_the_same_tokens() -> None:
    sched, runner = make(num_pages=6, page_size=2, max_step_tokens=16)
    prompts = {"a": [1, 2, 3], "b": [4, 5, 6], "c": [7, 8, 9]}
    for rid, prompt in prompts.items():
        sched.add(new(rid, prompt, max_tokens=6), 0.0)
    outs = run_all(sched, runner)
    assert sched.stats()["num_preemptions"] > 0
    for rid, prompt in prompts.items():
        alone, solo_runner = make()
        alone.add(new(rid, prompt, max_tokens=6), 0.0)
        assert result(outs[rid])["token_ids"] == result(run_all(alone, solo_runner)[rid])["token_ids"]
        assert len([e for e in outs[rid] if e.kind is EmitKind.STREAM]) == 6


def test_a_sequence_that_outgrows_the_whole_cache_fails() -> None:
    sched, runner = make(num_pages=2, page_size=2, max_model_len=100)
    sched.add(new("a", [1, 2, 3], max_tokens=50), 0.0)
    emits = run_all(sched, runner)["a"]
    assert emits[-1].kind is EmitKind.ERROR and "outgrew the KV cache" in emits[-1].message
    assert sum(e.kind is EmitKind.STREAM for e in emits) == 2
    check_pages(sched)


def test_history_only_for_a_repetition_penalty() -> None:
    sched, _ = make()
    sched.add(new("a", [1, 2], repetition_penalty=1.2), 0.0)
    sched.add(new("b", [1, 2]), 0.0)
    batch = sched.schedule(0.0)
    assert batch is not None and [s.history for s in batch.seqs] == [(1, 2), ()]


@pytest.mark.parametrize(("item", "match"), [
    (new("x", [1, 2], temperature=-1), "temperature"),
    (new("x", [1, 2], bogus=1), "unknown field"),
    (new("x", None), "token_ids"),
    (new("x", [1, "2"]), "token_ids"),
    (new("x", [1, -2]), "token_ids"),
    (new("x", []), "empty"),
    (new("x", list(range(20))), "max_model_len"),
    (new("x", list(range(17)), max_tokens=1), "never fit"),
])
def test_bad_requests_are_refused_with_value_error(item: Any, match: str) -> None:
    sched, _ = make(num_pages=4, page_size=4, max_model_len=20)
    with pytest.raises(ValueError, match=match):
        sched.add(item, 0.0)
    assert sched.active_request_ids == set()


def test_input_protocol_errors() -> None:
    sched, _ = make(max_model_len=8)
    sched.add(chunk("ghost", [1]), 0.0)  # unknown: ignored
    sched.add(done("ghost"), 0.0)
    sched.add(new("a", [1]), 0.0)
    with pytest.raises(ValueError, match="already"):
        sched.add(new("a", [1]), 0.0)
    with pytest.raises(ValueError, match="after its input ended"):
        sched.add(chunk("a", [2]), 0.0)
    sched.add(new("s", None, is_stream=True), 0.0)
    with pytest.raises(ValueError, match="no prompt tokens"):
        sched.add(done("s"), 0.0)
    with pytest.raises(ValueError, match="max_model_len"):
        sched.add(chunk("s", list(range(8))), 0.0)


class _ARRunner(Runner[ARBatch, ARResult]):
    def __init__(self, spec: Any) -> None:
        self.ar_spec = spec

    def execute(self, batch: ARBatch) -> ARResult:
        raise NotImplementedError


def test_the_ar_builder_reads_the_runner_spec() -> None:
    stage = StageConfig("llm", "x.y:z", scheduler="ar", max_batch_size=3, max_step_tokens=32, prefix_cache=False)
    sched = SCHEDULER_BUILDERS["ar"](stage, _ARRunner(ARSpec(10, 16, 512)))
    assert isinstance(sched, ARScheduler)
    assert (sched.max_batch_size, sched.max_step_tokens, sched.cache.is_enabled) == (3, 32, False)
    with pytest.raises(TypeError, match="stage 'llm'.*ar_spec"):
        SCHEDULER_BUILDERS["ar"](stage, _ARRunner(None))


def test_no_busy_wait_while_an_idle_stream_holds_the_pages_a_waiting_request_needs() -> None:
    sched, runner = make(num_pages=4, page_size=2)
    sched.add(new("s", list(range(7)), is_stream=True, max_tokens=1), 0.0)
    assert shape(step(sched, runner)[0]) == [("s", 0, 6, False)]
    sched.add(new("a", [9, 9, 9, 9, 9], max_tokens=1), 0.0)
    assert sched.next_wakeup(0.0) == 0.0
    assert sched.schedule(0.0) is None  # a needs 3 pages, 1 is free
    assert sched.next_wakeup(0.0) is None  # until new input or an exit
    sched.add(done("s"), 0.0)
    assert sched.next_wakeup(0.0) == 0.0
    emits = run_all(sched, runner)
    assert result(emits["s"])["finish_reason"] == result(emits["a"])["finish_reason"] == "length"


def test_an_output_limit_holds_sampling_steps_until_it_is_raised() -> None:
    # NOTE: the talker's case: a frame needs the text vector of upstream input that may not have
    # arrived yet, so its runner raises `max_num_outputs` as that input arrives.
    sched, runner = make(max_step_tokens=8)
    sched.add(WorkItem("t", WorkKind.NEW, {"token_ids": [1, 2, 3], "max_num_outputs": 1}, {"sampling": {}}), 0.0)
    sched.add(new("free", [4, 5], max_tokens=4), 0.0)
    emits = run_all(sched, runner)
    assert [len(e.payload["token_ids"]) for e in emits["t"]] == [1], "one output, then held"
    assert result(emits["free"])["finish_reason"] == "length", "an ungated request is not held"
    assert sched.next_wakeup(0.0) is None, "a held request must not keep the loop busy"
    assert sched.stats()["num_running"] == 1
    sched.add(WorkItem("t", WorkKind.CHUNK, {"max_num_outputs": 3}), 0.0)
    emits = run_all(sched, runner)
    assert len(emits["t"]) == 2 and all(e.kind is EmitKind.STREAM for e in emits["t"])
    sched.add(WorkItem("t", WorkKind.CHUNK, {"max_num_outputs": None}), 0.0)  # upstream ended: no limit
    emits = run_all(sched, runner)
    assert result(emits["t"])["finish_reason"] == "length" and len(result(emits["t"])["token_ids"]) == 256 - 3
    check_pages(sched)
    assert sched.stats()["num_used_pages"] == 0


def test_a_gated_stream_gets_its_prompt_and_end_in_one_chunk_and_a_limit_never_drops() -> None:
    sched, runner = make()
    sched.add(WorkItem("t", WorkKind.NEW, {"token_ids": [], "max_num_outputs": 0}, {}, is_stream=True), 0.0)
    assert sched.schedule(0.0) is None
    sched.add(WorkItem("t", WorkKind.CHUNK, {"token_ids": [1, 2], "is_input_done": True, "max_num_outputs": 2}), 0.0)
    emits = run_all(sched, runner)
    assert len(emits["t"]) == 2
    with pytest.raises(ValueError, match="lowered"):
        sched.add(WorkItem("t", WorkKind.CHUNK, {"max_num_outputs": 1}), 0.0)
    with pytest.raises(ValueError, match="prompt input after"):
        sched.add(WorkItem("t", WorkKind.CHUNK, {"token_ids": [3]}), 0.0)


def test_a_preempted_gated_request_recomputes_up_to_its_limit_only() -> None:
    sched, runner = make(num_pages=4, page_size=4, max_step_tokens=16)
    sched.add(new("grow", [1, 2, 3, 4], max_tokens=8), 0.0)
    sched.add(WorkItem("t", WorkKind.NEW, {"token_ids": [1, 2, 3, 4, 5], "max_num_outputs": 2}, {}), 0.0)
    emits = run_all(sched, runner)  # "grow" needs a 5th page at 9 tokens: "t", admitted last, is preempted
    assert sched.num_preemptions >= 1
    assert result(emits["grow"])["finish_reason"] == "length"
    assert len(emits["t"]) == 2
    sched.add(WorkItem("t", WorkKind.CHUNK, {"max_num_outputs": 3}), 0.0)
    emits = run_all(sched, runner)
    assert [e.kind for e in emits["t"]] == [EmitKind.STREAM], "exactly the one newly allowed output"
    check_pages(sched)


def test_tokens_past_the_cacheable_prefix_never_hit_or_fill_the_prefix_cache() -> None:
    sched, runner = make(page_size=4)
    prompt = list(range(1, 13))  # positions 8.. stand for audio placeholders: same ids, other audio
    for rid in ("a", "b"):
        sched.add(WorkItem(rid, WorkKind.NEW, {"token_ids": prompt, "num_cacheable_tokens": 9},
                           {"sampling": {"max_tokens": 1}}), 0.0)
        run_all(sched, runner)
    stats = sched.stats()
    assert stats["num_prefix_hit_tokens"] == 8, "only the two pages before position 9"
    assert stats["num_cached_pages"] == 2


def test_a_spec_that_is_not_prefix_cacheable_turns_the_cache_off() -> None:
    stage = StageConfig("talker", "x.y:z", scheduler="ar", prefix_cache=True)

    class Talkerish(Runner[ARBatch, ARResult]):
        ar_spec = ARSpec(8, 4, 64, (), is_prefix_cacheable=False)

        def execute(self, batch: ARBatch) -> ARResult:
            raise NotImplementedError

    sched = SCHEDULER_BUILDERS["ar"](stage, Talkerish())
    assert isinstance(sched, ARScheduler) and not sched.cache.is_enabled


def test_the_turn_end_row_rides_with_the_chunk_that_computes_it_and_never_comes_from_the_cache() -> None:
    sched, runner = make(max_step_tokens=8)
    prompt = list(range(1, 21))
    sched.add(WorkItem("a", WorkKind.NEW, {"token_ids": prompt, "turn_end_pos": 10}, {"sampling": {"max_tokens": 2}}),
              0.0)
    rows = []
    while (batch := step(sched, runner)[0]) is not None:
        rows += [(s.start_pos, s.turn_end_row) for s in batch.seqs]
    assert rows == [(0, None), (8, 2), (16, None), (20, None)]  # position 10 = row 2 of the chunk from 8
    # The same prompt again: its first 16 tokens are cached, but position 10 is computed (and scored) anew,
    # from the last full page before it.
    sched.add(WorkItem("b", WorkKind.NEW, {"token_ids": prompt, "turn_end_pos": 10}, {"sampling": {"max_tokens": 1}}),
              0.0)
    batch, _ = step(sched, runner)
    assert batch is not None and [(s.start_pos, s.turn_end_row) for s in batch.seqs] == [(8, 2)]
    run_all(sched, runner)
    sched.add(new("c", prompt, max_tokens=1), 0.0)  # NOTE: not scored: the cache serves all it can
    batch, _ = step(sched, runner)
    assert batch is not None and [(s.start_pos, s.turn_end_row) for s in batch.seqs] == [(16, None)]


def test_a_turn_end_pos_outside_the_prompt_is_refused() -> None:
    sched, _ = make()
    with pytest.raises(ValueError, match="payload.turn_end_pos"):
        sched.add(WorkItem("a", WorkKind.NEW, {"token_ids": [1, 2, 3], "turn_end_pos": 3}, {}), 0.0)
    with pytest.raises(ValueError, match="payload.turn_end_pos"):
        sched.add(WorkItem("a", WorkKind.NEW, {"token_ids": [1, 2, 3], "turn_end_pos": -1}, {}), 0.0)
