"""Code2WavScheduler with no model: chunk sizes, flush on DONE, empty streams, aborts, batching
fairness, and failure isolation (a failed batch's chunks re-run alone, only a culprit errors)."""

from __future__ import annotations

import pytest

from voice_server.config import ConfigError, StageConfig, pipeline_from_dict
from voice_server.scheduling import SCHEDULER_BUILDERS, Code2WavScheduler, EmitKind, WorkItem, WorkKind
from voice_server.scheduling.base import Emit
from voice_server.scheduling.contract import (
    Code2WavBatch,
    Code2WavChunk,
    Code2WavOutput,
    Code2WavResult,
    Code2WavSpec,
)

SPEC = Code2WavSpec(sample_rate=24000)
SAMPLES_PER_FRAME, TAIL = 10, 5


def fake_result(batch: Code2WavBatch) -> Code2WavResult:
    """Like the vocoder's accounting in spirit: samples per frame, plus a held-back tail on the last chunk."""
    outputs = []
    for c in batch.chunks:
        num = c.num_frames * SAMPLES_PER_FRAME + (TAIL if c.is_last and c.num_frames_before + c.num_frames else 0)
        outputs.append(Code2WavOutput(f"pcm:{c.request_id}:{c.num_frames_before}", num))
    return Code2WavResult(tuple(outputs))


def new(rid: str, num_frames: int | None = None) -> WorkItem:
    if num_frames is None:
        return WorkItem(rid, WorkKind.NEW, is_stream=True)
    return WorkItem(rid, WorkKind.NEW, {"num_frames": num_frames})


def chunk(rid: str, num_frames: int) -> WorkItem:
    return WorkItem(rid, WorkKind.CHUNK, {"num_frames": num_frames})


def done(rid: str) -> WorkItem:
    return WorkItem(rid, WorkKind.DONE)


def run(sched: Code2WavScheduler) -> tuple[list[Code2WavBatch], list[Emit]]:
    """Schedule and execute until idle."""
    batches, emits = [], []
    while (batch := sched.schedule(0.0)) is not None:
        batches.append(batch)
        emits += sched.update(batch, fake_result(batch))
    assert sched.next_wakeup(0.0) is None
    return batches, emits


def spans(batches: list[Code2WavBatch], rid: str) -> list[tuple[int, int, bool]]:
    return [(c.num_frames_before, c.num_frames, c.is_last) for b in batches for c in b.chunks if c.request_id == rid]


def test_first_chunk_is_short_then_chunk_frames_then_the_rest_on_done() -> None:
    sched = Code2WavScheduler(SPEC, max_batch_size=4)
    sched.add(new("a"), 0.0)
    sched.add(chunk("a", 1), 0.0)
    assert sched.schedule(0.0) is None and sched.next_wakeup(0.0) is None  # 1 frame < initial 2
    batches, emits = [], []
    for _ in range(24):
        sched.add(chunk("a", 1), 0.0)
        got, out = run(sched)
        batches += got
        emits += out
    assert spans(batches, "a") == [(0, 2, False), (2, 10, False), (12, 10, False)]
    assert all(e.kind is EmitKind.STREAM for e in emits)
    sched.add(done("a"), 0.0)
    got, out = run(sched)
    assert spans(got, "a") == [(22, 3, True)]
    assert [e.kind for e in out] == [EmitKind.STREAM, EmitKind.RESULT]
    stream = out[0].payload
    assert stream["sample_rate"] == 24000 and stream["num_frames"] == 3 and stream["pcm"] == "pcm:a:22"
    assert out[1].payload == {"num_samples": 25 * SAMPLES_PER_FRAME + TAIL, "num_frames": 25}
    assert sched.active_request_ids == set()
    assert sched.stats()["num_frames_decoded"] == 25 and sched.stats()["num_streams_done"] == 1


def test_done_with_no_frame_left_flushes_the_tail() -> None:
    sched = Code2WavScheduler(SPEC, max_batch_size=4)
    sched.add(new("a"), 0.0)
    sched.add(chunk("a", 12), 0.0)
    batches, _ = run(sched)
    assert spans(batches, "a") == [(0, 2, False), (2, 10, False)]
    sched.add(done("a"), 0.0)
    batches, emits = run(sched)
    assert spans(batches, "a") == [(12, 0, True)]
    assert [e.kind for e in emits] == [EmitKind.STREAM, EmitKind.RESULT]  # the tail samples, then the end
    assert emits[0].payload["num_frames"] == 0


def test_a_stream_with_no_frames_ends_with_an_empty_result() -> None:
    sched = Code2WavScheduler(SPEC, max_batch_size=4)
    sched.add(new("a"), 0.0)
    sched.add(done("a"), 0.0)
    batches, emits = run(sched)
    assert spans(batches, "a") == [(0, 0, True)]
    assert [(e.kind, e.payload) for e in emits] == [(EmitKind.RESULT, {"num_samples": 0, "num_frames": 0})]


def test_a_whole_request_is_chunked_like_a_stream() -> None:
    sched = Code2WavScheduler(SPEC, max_batch_size=4, initial_chunk_frames=3, chunk_frames=5)
    sched.add(new("a", 14), 0.0)
    batches, emits = run(sched)
    assert spans(batches, "a") == [(0, 3, False), (3, 5, False), (8, 5, False), (13, 1, True)]
    assert emits[-1].payload == {"num_samples": 14 * SAMPLES_PER_FRAME + TAIL, "num_frames": 14}


def test_ready_streams_share_steps_round_robin() -> None:
    sched = Code2WavScheduler(SPEC, max_batch_size=2)
    for rid in "abc":
        sched.add(new(rid), 0.0)
        sched.add(chunk(rid, 42), 0.0)
        sched.add(done(rid), 0.0)
    batches, emits = run(sched)
    assert all(len(b.chunks) <= 2 for b in batches)
    # NOTE: every 3 consecutive chunks served are 3 different streams: none waits two turns.
    order = [c.request_id for b in batches for c in b.chunks]
    assert all(len(set(order[i : i + 3])) == 3 for i in range(0, len(order) - 2, 3))
    for rid in "abc":
        assert spans(batches, rid) == [(0, 2, False), (2, 10, False), (12, 10, False), (22, 10, False),
                                       (32, 10, True)]
    assert sorted(e.request_id for e in emits if e.kind is EmitKind.RESULT) == ["a", "b", "c"]


def test_abort_drops_the_stream_its_queued_reruns_and_late_chunks() -> None:
    sched = Code2WavScheduler(SPEC, max_batch_size=4)
    for rid in "ab":
        sched.add(new(rid), 0.0)
        sched.add(chunk(rid, 5), 0.0)
    batch = sched.schedule(0.0)
    assert batch is not None and len(batch.chunks) == 2
    assert sched.fail(batch, "boom") == []  # both queued to re-run alone
    assert sched.abort("a") and not sched.abort("a")
    sched.add(chunk("a", 3), 0.0)  # late: ignored
    rerun = sched.schedule(0.0)
    assert rerun is not None and [c.request_id for c in rerun.chunks] == ["b"]
    # NOTE: a batch that ran while "a" was aborted drops its part of the result.
    sched.add(new("c"), 0.0)
    sched.add(chunk("c", 2), 0.0)
    running = sched.schedule(0.0)
    assert running is not None
    sched.abort("c")
    assert sched.update(running, fake_result(running)) == []
    assert sched.active_request_ids == {"b"}


def test_a_failing_member_is_isolated_and_the_others_keep_their_frames() -> None:
    sched = Code2WavScheduler(SPEC, max_batch_size=4)
    for rid in "abc":
        sched.add(new(rid), 0.0)
        sched.add(chunk(rid, 12), 0.0)
        sched.add(done(rid), 0.0)
    first = sched.schedule(0.0)
    assert first is not None and len(first.chunks) == 3
    assert sched.fail(first, "RuntimeError: bad codes") == []
    solos = [sched.schedule(0.0) for _ in range(3)]
    assert [list(b.chunks) for b in solos if b] == [[c] for c in first.chunks]  # same chunks, alone
    emits: list[Emit] = []
    for batch in solos:
        assert batch is not None
        if batch.chunks[0].request_id == "b":
            emits += sched.fail(batch, "RuntimeError: bad codes")
        else:
            emits += sched.update(batch, fake_result(batch))
    assert [(e.request_id, e.kind) for e in emits if e.kind is EmitKind.ERROR] == [("b", EmitKind.ERROR)]
    batches, rest = run(sched)
    emits += rest
    for rid in "ac":
        assert spans(batches, rid) == [(2, 10, True)]
        result = [e for e in emits if e.request_id == rid and e.kind is EmitKind.RESULT]
        assert result[0].payload == {"num_samples": 12 * SAMPLES_PER_FRAME + TAIL, "num_frames": 12}
    assert sched.active_request_ids == set()


def test_contract_refuses_inconsistent_chunks_and_batches() -> None:
    with pytest.raises(ValueError, match="num_frames must be an integer >= 1"):
        Code2WavChunk("a", 0, 0, is_last=False)
    with pytest.raises(ValueError, match="two chunks of one stream"):
        Code2WavBatch((Code2WavChunk("a", 0, 2, False), Code2WavChunk("a", 2, 2, True)))
    assert Code2WavChunk("a", 0, 0, is_last=True).is_first
    with pytest.raises(ValueError, match="payload.num_frames"):
        Code2WavScheduler(SPEC, 1).add(WorkItem("x", WorkKind.NEW, {"codes": [[1]]}), 0.0)


def test_builder_reads_the_stage_fields_and_needs_a_spec() -> None:
    stage = StageConfig("voc", "x.y:z", scheduler="code2wav", max_batch_size=3, initial_chunk_frames=1,
                        chunk_frames=7)

    class WithSpec:
        code2wav_spec = SPEC

    sched = SCHEDULER_BUILDERS["code2wav"](stage, WithSpec())  # type: ignore[arg-type]
    assert isinstance(sched, Code2WavScheduler)
    assert (sched.max_batch_size, sched.initial_chunk_frames, sched.chunk_frames) == (3, 1, 7)
    with pytest.raises(TypeError, match="code2wav_spec"):
        SCHEDULER_BUILDERS["code2wav"](stage, object())  # type: ignore[arg-type]


@pytest.mark.parametrize("field_name", ["initial_chunk_frames", "chunk_frames"])
def test_chunk_fields_are_refused_naming_the_field(field_name: str) -> None:
    raw = {"name": "t", "stages": [{"name": "voc", "factory": "x.y:z", "scheduler": "code2wav", "terminal": True,
                                    field_name: 0}]}
    with pytest.raises(ConfigError, match=f"stage 'voc': field '{field_name}'"):
        pipeline_from_dict(raw)
