"""TalkerRunner under the ARScheduler, fed the thinker's token stream one chunk at a time (in-process).

Shows the streaming rule of `talker_feed.py`: the prefill runs once the second reply token arrives,
each later token allows one more frame, the thinker's end lifts the limit, and the frames equal the
reference frame loop (`turn.generate_frames`) on the prefill transformers' `generate` would build
from the whole turn. Two requests are interleaved so steps batch them.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from talker_streams import CFG, models, thinker_chunks

from voice_server.models.qwen3_omni.presets import tiny_prompt_ids
from voice_server.models.qwen3_omni.talker.model import Talker
from voice_server.models.qwen3_omni.talker.prefill import build_talker_prefill
from voice_server.models.qwen3_omni.talker.sampling import TalkerSampling
from voice_server.models.qwen3_omni.thinker.model import ThinkerModel
from voice_server.models.qwen3_omni.turn import ThinkerTurn, generate_frames, run_greedy_thinker, turn_token_ids
from voice_server.runners.talker_runner import TalkerRunner, TalkerRunnerConfig
from voice_server.scheduling import ARScheduler, Emit, EmitKind, WorkItem, WorkKind
from voice_server.scheduling.contract import ARSeq

torch.set_num_threads(1)

def reference_codes(thinker: ThinkerModel, talker: Talker, turn: ThinkerTurn, prompt_len: int,
                    max_frames: int) -> torch.Tensor:
    ids = turn_token_ids(CFG)
    with torch.no_grad():
        tts = thinker.model.language_model.embed_tokens(torch.tensor(ids.tts_special_ids))
        prefill = build_talker_prefill(talker, ids, turn.consumed_ids, prompt_len, turn.inputs_embeds,
                                       turn.accepted_hidden, tts, "ethan")
    frames = generate_frames(talker, prefill, max_frames, TalkerSampling())
    return torch.stack([f.codes[0] for f in frames], dim=-1)


def drain(sched: ARScheduler, runner: TalkerRunner) -> list[Emit]:
    emits: list[Emit] = []
    while (batch := sched.schedule(0.0)) is not None:
        emits += sched.update(batch, runner.execute(batch))
    return emits


@pytest.mark.parametrize("decode_graphs", ["off", "on", "compiled"])
def test_frames_follow_the_thinker_stream_and_equal_the_reference(decode_graphs: str) -> None:
    # NOTE: "on" runs decode-only steps on the fixed-shape buffers the CUDA graphs replay (eagerly on
    # the CPU): padded page tables, one masked attention per layer, bucketed batch sizes; positions
    # past `graph_max_len` (32 here) step on the exact path, so a turn mixes both.
    thinker, talker = models()
    # "compiled": the same buffers stepped by torch.compile (one bucket, to bound the compile time).
    is_compiled = decode_graphs == "compiled"
    config = TalkerRunnerConfig(budget_bytes=256 << 20, thinker_hidden_size=32, page_size=4,
                                decode_graphs="on" if is_compiled else decode_graphs, graph_max_len=32,
                                graph_buckets=(2,) if is_compiled else (1, 2, 4), compile=is_compiled)
    runner = TalkerRunner(talker, turn_token_ids(CFG), config)
    sched = ARScheduler(runner.ar_spec, max_batch_size=4, max_step_tokens=64, prefix_cache=False)
    cases = {"a": (tiny_prompt_ids(num_user_text=5), 7, 30), "b": (tiny_prompt_ids(num_user_text=11), 9, 30)}
    streams, expected = {}, {}
    for rid, (prompt, num_tokens, max_frames) in cases.items():
        turn = run_greedy_thinker(thinker, torch.tensor([prompt]), CFG.talker.accept_hidden_layer, 10**6, num_tokens)
        streams[rid] = thinker_chunks(thinker, turn, len(prompt))
        expected[rid] = reference_codes(thinker, talker, turn, len(prompt), max_frames)
        new = WorkItem(rid, WorkKind.NEW, {}, {"talker": {"max_frames": max_frames}}, is_stream=True)
        sched.add(runner.admit(new), 0.0)
    frames: dict[str, list[torch.Tensor]] = {rid: [] for rid in cases}
    for k in range(max(len(s) for s in streams.values())):
        for rid, chunks in streams.items():
            if k < len(chunks):
                sched.add(runner.admit(WorkItem(rid, WorkKind.CHUNK, chunks[k], seq=k)), 0.0)
        for emit in drain(sched, runner):
            if "codes" in emit.payload:
                frames[emit.request_id].append(emit.payload["codes"])
        for rid, chunks in streams.items():
            if k < len(chunks):
                # NOTE: after k + 1 reply tokens, k - 1 are known not to be the last: the prefill's
                # frame plus one frame per text vector.
                assert len(frames[rid]) == min(k, expected[rid].shape[-1]), (rid, k)
    assert sched.next_wakeup(0.0) is None, "held requests must not spin"
    for rid, chunks in streams.items():
        sched.add(runner.admit(WorkItem(rid, WorkKind.DONE, {}, seq=len(chunks))), 0.0)
    finals = [e for e in drain(sched, runner) if e.kind is EmitKind.RESULT or "codes" in e.payload]
    for emit in finals:
        if "codes" in emit.payload:
            frames[emit.request_id].append(emit.payload["codes"])
    for rid in cases:
        assert torch.equal(torch.cat(frames[rid], dim=1), expected[rid]), rid
    assert {e.request_id for e in finals if e.kind is EmitKind.RESULT} == set(cases)
    assert sched.stats()["num_used_pages"] == 0 and sched.stats()["num_cached_pages"] == 0
    if decode_graphs != "off":
        assert runner.graphs is not None and runner.graphs.num_steps >= 5
        assert runner.graphs.is_compiled == is_compiled


def run_sampled(decode_graphs: str) -> dict[str, torch.Tensor]:
    thinker, talker = models()
    config = TalkerRunnerConfig(budget_bytes=256 << 20, thinker_hidden_size=32, page_size=4,
                                sampling=TalkerSampling.hf_sampling(), seed=11, decode_graphs=decode_graphs,
                                graph_max_len=32)
    runner = TalkerRunner(talker, turn_token_ids(CFG), config)
    sched = ARScheduler(runner.ar_spec, max_batch_size=4, max_step_tokens=64, prefix_cache=False)
    frames: dict[str, list[torch.Tensor]] = {}
    for rid, num_text in (("a", 5), ("b", 11)):
        prompt = tiny_prompt_ids(num_user_text=num_text)
        turn = run_greedy_thinker(thinker, torch.tensor([prompt]), CFG.talker.accept_hidden_layer, 10**6, 6)
        sched.add(runner.admit(WorkItem(rid, WorkKind.NEW, {}, {"talker": {"max_frames": 24}}, is_stream=True)), 0.0)
        for k, chunk in enumerate(thinker_chunks(thinker, turn, len(prompt))):
            sched.add(runner.admit(WorkItem(rid, WorkKind.CHUNK, chunk, seq=k)), 0.0)
        sched.add(runner.admit(WorkItem(rid, WorkKind.DONE, {}, seq=6)), 0.0)
        frames[rid] = []
    for emit in drain(sched, runner):
        if "codes" in emit.payload:
            frames[emit.request_id].append(emit.payload["codes"])
    if decode_graphs == "on":
        assert runner.graphs is not None and runner.graphs.num_steps >= 5
    return {rid: torch.cat(f, dim=1) for rid, f in frames.items()}


def test_sampled_frames_are_the_same_on_the_graph_path_and_the_exact_path() -> None:
    # NOTE: both paths draw with noise pre-drawn from each request's seeded generator (what a CUDA
    # graph of a sampled step replays), so a sampled request's frames do not depend on the path.
    eager, graphs = run_sampled("off"), run_sampled("on")
    for rid in eager:
        assert eager[rid].shape[1] >= 3 and torch.equal(eager[rid], graphs[rid]), rid
    greedy = run_greedy_codes()
    num = min(greedy.shape[1], eager["a"].shape[1])
    assert not torch.equal(eager["a"][:, :num], greedy[:, :num]), "sampling must differ from greedy"


def run_greedy_codes() -> torch.Tensor:
    thinker, talker = models()
    prompt = tiny_prompt_ids(num_user_text=5)
    turn = run_greedy_thinker(thinker, torch.tensor([prompt]), CFG.talker.accept_hidden_layer, 10**6, 6)
    return reference_codes(thinker, talker, turn, len(prompt), 24)


def test_a_reply_stops_at_the_models_positions() -> None:
    # NOTE: the tiny talker has 512 positions (its cos/sin table); the default max_model_len (32768) must
    # not let a long reply step past them: it ends there (found by loadtest/locustfile.py on the tiny config).
    thinker, talker = models()
    config = TalkerRunnerConfig(budget_bytes=256 << 20, thinker_hidden_size=32, page_size=16, decode_graphs="off")
    runner = TalkerRunner(talker, turn_token_ids(CFG), config)
    assert runner.ar_spec.max_model_len == CFG.talker.max_position_embeddings == 512
    sched = ARScheduler(runner.ar_spec, max_batch_size=4, max_step_tokens=256, prefix_cache=False)
    prompt = tiny_prompt_ids(num_user_text=5)
    turn = run_greedy_thinker(thinker, torch.tensor([prompt]), CFG.talker.accept_hidden_layer, 10**6, 6)
    sched.add(runner.admit(WorkItem("a", WorkKind.NEW, {}, {"talker": {"max_frames": 4096}}, is_stream=True)), 0.0)
    for k, chunk in enumerate(thinker_chunks(thinker, turn, len(prompt))):
        sched.add(runner.admit(WorkItem("a", WorkKind.CHUNK, chunk, seq=k)), 0.0)
    sched.add(runner.admit(WorkItem("a", WorkKind.DONE, {}, seq=6)), 0.0)
    emits = drain(sched, runner)
    num_frames = sum(e.payload["codes"].shape[1] for e in emits if "codes" in e.payload)
    assert [e.kind for e in emits if e.kind is not EmitKind.STREAM] == [EmitKind.RESULT], emits[-1]
    assert 0 < num_frames < 512


def test_a_reply_with_no_token_to_speak_ends_with_no_frame_beside_a_spoken_one() -> None:
    # NOTE: a reply that is only its EOS (or only tool calls, whose tokens the thinker never streams) leaves the
    # talker nothing to speak: its one step is the codec EOS, taken beside the spoken reply's steps, which make
    # the reference's frames as alone. A stream that ended with no chunk at all is silent too.
    thinker, talker = models()
    config = TalkerRunnerConfig(budget_bytes=256 << 20, thinker_hidden_size=32, page_size=4, decode_graphs="off")
    runner = TalkerRunner(talker, turn_token_ids(CFG), config)
    sched = ARScheduler(runner.ar_spec, max_batch_size=4, max_step_tokens=64, prefix_cache=False)
    prompt = tiny_prompt_ids(num_user_text=5)
    turn = run_greedy_thinker(thinker, torch.tensor([prompt]), CFG.talker.accept_hidden_layer, 10**6, 6)
    chunks = thinker_chunks(thinker, turn, len(prompt))
    streams = {"spoken": chunks, "silent": chunks[:1], "empty": []}
    for rid, stream in streams.items():
        sched.add(runner.admit(WorkItem(rid, WorkKind.NEW, {}, {"talker": {"max_frames": 12}}, is_stream=True)), 0.0)
        for k, chunk in enumerate(stream):
            sched.add(runner.admit(WorkItem(rid, WorkKind.CHUNK, chunk, seq=k)), 0.0)
        sched.add(runner.admit(WorkItem(rid, WorkKind.DONE, {}, seq=len(stream))), 0.0)
    emits: list[Emit] = []
    batches = []
    while (batch := sched.schedule(0.0)) is not None:
        batches.append({s.request_id for s in batch.seqs})
        emits += sched.update(batch, runner.execute(batch))
    assert batches[0] == set(streams), "the silent steps share the spoken reply's prefill step"
    eos = CFG.talker.codec_eos_token_id
    for rid in ("silent", "empty"):
        mine = [e for e in emits if e.request_id == rid]
        assert [(e.kind, e.payload["token_ids"], "codes" in e.payload) for e in mine] == [
            (EmitKind.STREAM, [eos], False), (EmitKind.RESULT, [eos], False)], rid
        assert mine[-1].payload["finish_reason"] == "stop"
    frames = [e.payload["codes"] for e in emits if e.request_id == "spoken" and "codes" in e.payload]
    assert torch.equal(torch.cat(frames, dim=1), reference_codes(thinker, talker, turn, len(prompt), 12))
    assert sched.stats()["num_used_pages"] == 0 and not sched.active_request_ids


class FailingRunner(TalkerRunner):
    """Has no frame for a request named `bad*`: a step that makes one raises after it drew every frame's
    noise and (in batch order) built its other sequences' frames, as a frame out of device memory would."""

    def _frame_data(self, seq: ARSeq, codes: torch.Tensor) -> dict[str, Any]:
        if seq.request_id.startswith("bad"):
            raise RuntimeError(f"no frame for {seq.request_id}")
        return super()._frame_data(seq, codes)


def serve_with_failures(sampling: TalkerSampling, bad_steps: tuple[int, ...]) -> torch.Tensor:
    """Request `a`'s frames under the scheduler (the stage's loop, failed batches included) on a fresh runner
    (the same seed stream every time), with a `bad*` request joining at each step in `bad_steps`."""
    thinker, talker = models()
    # NOTE: seed 16: the sampled reply runs all 24 frames (the dummy talker often samples codec EOS early).
    config = TalkerRunnerConfig(budget_bytes=256 << 20, thinker_hidden_size=32, page_size=4, sampling=sampling,
                                seed=16, decode_graphs="off")
    runner = FailingRunner(talker, turn_token_ids(CFG), config)
    sched = ARScheduler(runner.ar_spec, max_batch_size=4, max_step_tokens=64, prefix_cache=False)
    prompt = tiny_prompt_ids(num_user_text=5)
    turn = run_greedy_thinker(thinker, torch.tensor([prompt]), CFG.talker.accept_hidden_layer, 10**6, 6)
    chunks = thinker_chunks(thinker, turn, len(prompt))
    arrivals: dict[int, list[str]] = {0: ["a"]}
    for k, step in enumerate(bad_steps):
        arrivals.setdefault(step, []).insert(0, f"bad{k}")  # NOTE: at step 0 before `a`: first in the batch
    frames: list[torch.Tensor] = []
    errors: dict[str, str | None] = {}
    step = 0
    while step <= max(arrivals) or sched.active_request_ids:
        for rid in arrivals.get(step, []):
            sched.add(runner.admit(WorkItem(rid, WorkKind.NEW, {}, {"talker": {"max_frames": 24}}, is_stream=True)),
                      0.0)
            for k, chunk in enumerate(chunks):
                sched.add(runner.admit(WorkItem(rid, WorkKind.CHUNK, chunk, seq=k)), 0.0)
            sched.add(runner.admit(WorkItem(rid, WorkKind.DONE, {}, seq=len(chunks))), 0.0)
        step += 1
        batch = sched.schedule(0.0)
        if batch is None:
            continue
        try:
            result = runner.execute(batch)
        except RuntimeError as exc:
            emits = sched.fail(batch, str(exc))
        else:
            emits = sched.update(batch, result)
        for emit in emits:
            if emit.request_id == "a" and "codes" in emit.payload:
                frames.append(emit.payload["codes"])
            if emit.kind is EmitKind.ERROR:
                errors[emit.request_id] = emit.message
            if emit.is_final:
                runner.release(emit.request_id)
    assert errors == {f"bad{k}": f"no frame for bad{k}" for k in range(len(bad_steps))}
    return torch.cat(frames, dim=1)


@pytest.mark.parametrize("sampling", [TalkerSampling.hf_sampling(), TalkerSampling()], ids=["sampled", "greedy"])
def test_a_request_rerun_after_a_step_failed_midway_makes_the_frames_it_makes_undisturbed(
    sampling: TalkerSampling,
) -> None:
    """Steps that raise after drawing are rerun member by member (the scheduler's policy); the requests'
    generators, the seed stream and the fed-back frames (`TalkerFeed.codec_sums`, `code0_seen`) move only
    for steps that succeeded, so the rerun request makes exactly the frames of a run where nothing failed."""
    undisturbed = serve_with_failures(sampling, ())
    # NOTE: at step 0 the bad request is first in the batch (it draws from the seed stream before `a`);
    # later ones join after `a` in the batch, so the step fails after `a`'s frame was built.
    disturbed = serve_with_failures(sampling, (0, 3, 7))
    assert undisturbed.shape[1] >= 8
    assert torch.equal(disturbed, undisturbed)
