"""SimpleScheduler on its own: plain Python, no model, no sockets."""

from __future__ import annotations

from voice_server.scheduling import Emit, EmitKind, SimpleResult, SimpleScheduler, WorkItem, WorkKind


def new(rid: str) -> WorkItem:
    return WorkItem(rid, WorkKind.NEW, {"x": rid})


def chunk(rid: str, seq: int) -> WorkItem:
    return WorkItem(rid, WorkKind.CHUNK, {"seq": seq}, seq=seq)


def test_batches_up_to_max_size_in_arrival_order() -> None:
    sched = SimpleScheduler(max_batch_size=3)
    for i in range(5):
        sched.add(new(f"r{i}"), now=0.0)
    first = sched.schedule(now=0.0)
    assert first is not None and [w.request_id for w in first.items] == ["r0", "r1", "r2"]
    second = sched.schedule(now=0.0)
    assert second is not None and [w.request_id for w in second.items] == ["r3", "r4"]
    assert sched.schedule(now=0.0) is None
    assert sched.next_wakeup(now=0.0) is None


def test_batch_window_waits_for_more_work_unless_full() -> None:
    sched = SimpleScheduler(max_batch_size=4, batch_window_s=0.010)
    sched.add(new("a"), now=1.000)
    assert sched.schedule(now=1.004) is None
    assert abs((sched.next_wakeup(now=1.004) or 0) - 0.006) < 1e-9
    sched.add(new("b"), now=1.005)
    batch = sched.schedule(now=1.011)
    assert batch is not None and len(batch.items) == 2
    for rid in "cdef":
        sched.add(new(rid), now=2.0)
    assert sched.next_wakeup(now=2.0) == 0.0  # a full batch does not wait


def test_abort_drops_queued_items_and_late_chunks() -> None:
    sched = SimpleScheduler(max_batch_size=8)
    sched.add(new("a"), now=0)
    sched.add(chunk("a", 0), now=0)
    sched.add(new("b"), now=0)
    assert sched.abort("a") and not sched.abort("zzz")
    sched.add(chunk("a", 1), now=0)  # late chunk of an aborted request
    batch = sched.schedule(now=0)
    assert batch is not None and [w.request_id for w in batch.items] == ["b"]
    assert sched.active_request_ids == {"b"}


def test_results_end_requests_and_emits_of_aborted_requests_are_dropped() -> None:
    sched = SimpleScheduler(max_batch_size=8)
    sched.add(new("a"), now=0)
    sched.add(new("b"), now=0)
    batch = sched.schedule(now=0)
    assert batch is not None
    sched.abort("b")  # while the batch runs
    emits = sched.update(batch, SimpleResult((
        Emit("a", EmitKind.STREAM, {"i": 0}), Emit("a", EmitKind.RESULT), Emit("b", EmitKind.RESULT),
    )))
    assert [(e.request_id, e.kind) for e in emits] == [("a", EmitKind.STREAM), ("a", EmitKind.RESULT)]
    assert sched.active_request_ids == set()


def test_failed_batch_retries_each_request_alone_and_errors_only_the_culprit() -> None:
    sched = SimpleScheduler(max_batch_size=8)
    sched.add(new("a"), now=0)
    sched.add(chunk("a", 0), now=0)
    sched.add(new("b"), now=0)
    sched.add(new("c"), now=1)
    batch = sched.schedule(now=0)
    assert batch is not None and len(batch.items) == 4
    assert sched.fail(batch, "boom") == []  # nobody fails yet
    solo_a = sched.schedule(now=0)
    assert solo_a is not None
    assert [(w.request_id, w.kind) for w in solo_a.items] == [("a", WorkKind.NEW), ("a", WorkKind.CHUNK)]
    assert sched.update(solo_a, SimpleResult((Emit("a", EmitKind.RESULT),)))[0].request_id == "a"
    solo_b = sched.schedule(now=0)
    assert solo_b is not None and [w.request_id for w in solo_b.items] == ["b"]
    emits = sched.fail(solo_b, "boom")
    assert [(e.request_id, e.kind, e.message) for e in emits] == [("b", EmitKind.ERROR, "boom")]
    solo_c = sched.schedule(now=0)
    assert solo_c is not None and [w.request_id for w in solo_c.items] == ["c"]
    assert sched.active_request_ids == {"c"}


def ids(batch: object) -> list[tuple[str, WorkKind]]:
    assert batch is not None
    return [(w.request_id, w.kind) for w in batch.items]  # type: ignore[attr-defined]


def test_first_output_urgent_serves_requests_that_have_emitted_nothing_yet() -> None:
    sched = SimpleScheduler(max_batch_size=1, is_first_output_urgent=True)
    sched.add(new("a"), now=0)
    sched.add(chunk("a", 0), now=0)
    assert ids(batch := sched.schedule(now=0)) == [("a", WorkKind.NEW)]
    sched.update(batch, SimpleResult(()))  # type: ignore[arg-type]
    assert ids(batch := sched.schedule(now=0)) == [("a", WorkKind.CHUNK)]
    # NOTE: a's first clause goes out; its later text is queued, then b arrives with nothing out yet.
    sched.update(batch, SimpleResult((Emit("a", EmitKind.STREAM, {"pcm": 0}),)))  # type: ignore[arg-type]
    for seq in (1, 2):
        sched.add(chunk("a", seq), now=0)
    sched.add(new("b"), now=0)
    sched.add(chunk("b", 0), now=0)
    sched.add(chunk("b", 1), now=0)
    order: list[tuple[str, WorkKind]] = []
    while (batch := sched.schedule(now=0)) is not None:
        order += ids(batch)
        is_b_first_clause = len(order) == 2  # b's first chunk completes its first clause
        sched.update(batch, SimpleResult((Emit("b", EmitKind.STREAM, {"pcm": 0}),) if is_b_first_clause else ()))
    # NOTE: b until its first output, then arrival order again (a's backlog before b's rest).
    assert order == [("b", WorkKind.NEW), ("b", WorkKind.CHUNK), ("a", WorkKind.CHUNK), ("a", WorkKind.CHUNK),
                     ("b", WorkKind.CHUNK)]


def test_first_output_urgent_forgets_finished_and_aborted_requests() -> None:
    sched = SimpleScheduler(max_batch_size=4, batch_window_s=10.0, is_first_output_urgent=True)
    sched.add(new("a"), now=0)
    assert sched.next_wakeup(now=0) == 0.0  # a request with nothing out yet does not wait out the window
    batch = sched.schedule(now=0)
    assert ids(batch) == [("a", WorkKind.NEW)]
    sched.update(batch, SimpleResult((Emit("a", EmitKind.STREAM, {"pcm": 0}), Emit("a", EmitKind.RESULT))))
    sched.add(new("b"), now=0)
    assert sched.abort("b")
    assert sched.schedule(now=0) is None and sched.next_wakeup(now=0) is None
    assert sched.active_request_ids == set() and not sched._started


def test_arrival_order_without_first_output_urgency() -> None:
    sched = SimpleScheduler(max_batch_size=1)
    sched.add(new("a"), now=0)
    batch = sched.schedule(now=0)
    sched.update(batch, SimpleResult((Emit("a", EmitKind.STREAM, {"pcm": 0}),)))  # type: ignore[arg-type]
    sched.add(chunk("a", 0), now=0)
    sched.add(new("b"), now=0)
    assert ids(sched.schedule(now=0)) == [("a", WorkKind.CHUNK)]
    assert ids(sched.schedule(now=0)) == [("b", WorkKind.NEW)]


def test_the_talker_serves_first_clauses_first() -> None:
    from voice_server.config import StageConfig
    from voice_server.runners.asr_runner import AsrRunner
    from voice_server.runners.tts_runner import TTSRunner
    from voice_server.scheduling import SCHEDULER_BUILDERS

    stage = StageConfig(name="s", factory="m:f", max_batch_size=4)
    talker = SCHEDULER_BUILDERS["simple"](stage, TTSRunner.__new__(TTSRunner))
    asr = SCHEDULER_BUILDERS["simple"](stage, AsrRunner.__new__(AsrRunner))
    assert isinstance(talker, SimpleScheduler) and talker.is_first_output_urgent
    assert isinstance(asr, SimpleScheduler) and not asr.is_first_output_urgent
