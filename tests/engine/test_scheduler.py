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
