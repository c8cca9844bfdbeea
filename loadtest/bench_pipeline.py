"""The streaming Qwen3-Omni pipeline on the tiny config, side by side in one run (CPU, 1 thread per process):

1. one ~4 s reply (50 codec frames): time to first audio and total, ours (encoder -> thinker ->
   talker+MTP -> code2wav, one process each, streamed) vs transformers' `generate(return_audio=True)`
   (audio only at the end), same weights (transformers' `save_pretrained`, read by our stages);
2. aggregate real-time factor (wall time / audio produced) at 1, 4 and 16 concurrent requests, in
   seconds of the tiny decoder's own samples and in frames at the released model's 12.5 Hz;
3. the same workload with every stage in one process (`process: omni`) vs one process per stage;
4. the Talker+MTP frame step alone: `step_paged` over S sequences vs transformers per frame.
Plus each stage's first-output latency (median of `TerminalOutput.timings`, single requests).

Run: `OMP_NUM_THREADS=1 .venv/bin/python loadtest/bench_pipeline.py [--quick]` (`make bench-pipeline`)
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("OMP_NUM_THREADS", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_gpu  # noqa: E402
import bench_talker  # noqa: E402
import torch  # noqa: E402
from table import cpu_description, format_table  # noqa: E402

from voice_server.config.loading import pipeline_from_dict, read_yaml  # noqa: E402
from voice_server.engine.coordinator import Coordinator  # noqa: E402
from voice_server.models.paged import PagedKVCache, build_attention_context  # noqa: E402
from voice_server.models.qwen3_omni.presets import TINY_IDS, tiny_config_dict, tiny_prompt_ids  # noqa: E402
from voice_server.models.qwen3_omni.talker.step import step_paged  # noqa: E402

CONFIG = Path(__file__).resolve().parents[1] / "configs" / "qwen3-omni-tiny.yaml"
FRAME_HZ = 12.5  # NOTE: the released model's codec frame rate; 50 frames = a 4 s reply
FRAMES = 50
TEXT_TOKENS = 16
# NOTE: random weights often end a reply early (codec EOS after ~16-26 frames with seed 0): with seed 4
# transformers' greedy turn gives 16 tokens and 50 frames for every prompt used here (frames are in every table).
SEED = 4
PROMPT = tiny_prompt_ids(num_user_text=6)
STAGES = ("encoder", "thinker", "talker", "code2wav")


def build_reference(folder: str, seed: int = SEED) -> Any:
    """The tiny transformers model with seeded weights, saved to `folder` for our stages to load."""
    import transformers

    ref = transformers.Qwen3OmniMoeForConditionalGeneration(transformers.Qwen3OmniMoeConfig(**tiny_config_dict()))
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():  # NOTE: HF leaves many params trivial (talker experts uninitialised): set every one
        for name, p in sorted(ref.named_parameters()):
            r = torch.randn(p.shape, generator=g)
            p.copy_(1.0 + 0.05 * r if p.ndim == 1 and "norm" in name else 0.1 * r)
    ref.eval().save_pretrained(folder)
    return ref


def reference_turn(ref: Any) -> dict[str, Any]:
    """One `generate(return_audio=True)`: its audio exists only when the call returns."""
    frames: list[int] = []
    decode = ref.code2wav.chunked_decode

    def spy(codes: torch.Tensor, **kw: object) -> torch.Tensor:  # NOTE: counts the frames HF decoded
        frames.append(int(codes.shape[-1]))
        return decode(codes, **kw)

    ref.code2wav.chunked_decode = spy
    try:
        t0 = time.perf_counter()
        with torch.no_grad():
            text_ids, wav = ref.generate(
                input_ids=torch.tensor([PROMPT]), speaker="Ethan", thinker_max_new_tokens=TEXT_TOKENS,
                thinker_do_sample=False, thinker_eos_token_id=TINY_IDS["im_end"],
                talker_max_new_tokens=FRAMES + 1, talker_do_sample=False,
            )
        total = time.perf_counter() - t0
    finally:
        del ref.code2wav.chunked_decode
    return {"first_audio_s": total, "total_s": total, "tokens": text_ids.shape[1] - len(PROMPT),
            "frames": frames[0], "samples": wav.numel()}


def pipeline_config(ckpt: str, process: str | None) -> Any:
    """configs/qwen3-omni-tiny.yaml with the saved checkpoint in place of the preset; `process`:
    one process group for every stage (None: the default, one process per stage)."""
    raw = read_yaml(CONFIG)
    for stage in raw["stages"]:
        stage["factory_args"] = {"checkpoint": ckpt, "num_threads": 1}
        if stage.get("scheduler") == "ar":  # NOTE: rounds repeat one prompt; transformers has no prefix cache
            stage["prefix_cache"] = False
        if process:
            stage["process"] = process
    return pipeline_from_dict(raw)


async def one_request(coordinator: Coordinator, prompt: list[int] = PROMPT) -> dict[str, Any]:
    params = {"sampling": {"max_tokens": TEXT_TOKENS, "ignore_eos": True}, "talker": {"max_frames": FRAMES}}
    t0 = time.monotonic()
    first_audio, tokens, frames, samples, rate, stamps = None, 0, 0, 0, 0, {}
    async for out in coordinator.submit({"token_ids": prompt}, params):
        if out.stage == "thinker" and out.is_final:
            tokens = len(out.payload.get("token_ids", []))
        if out.stage == "code2wav" and "pcm" in out.payload:
            first_audio = first_audio or time.monotonic()
            frames += int(out.payload["num_frames"])
            samples += len(out.payload["pcm"])
            rate, stamps = int(out.payload["sample_rate"]), out.timings
    done = time.monotonic()
    if first_audio is None:
        raise RuntimeError("the request produced no audio")
    latency = {s: stamps[s] - stamps["submit"] for s in STAGES if s in stamps}
    return {"first_audio_s": first_audio - t0, "total_s": done - t0, "tokens": tokens, "frames": frames,
            "samples": samples, "sample_rate": rate, "stages": latency, "start": t0, "end": done}


async def concurrent(coordinator: Coordinator, num: int) -> dict[str, Any]:
    """`num` requests submitted together: wall time over the audio they made (RTF < 1: faster than real time)."""
    t0 = time.monotonic()
    # NOTE: different prompts (1..num user tokens): requests of different lengths, as in a real burst.
    prompts = [tiny_prompt_ids(num_user_text=1 + i) for i in range(num)]
    runs = await asyncio.gather(*(one_request(coordinator, p) for p in prompts))
    wall = max(r["end"] for r in runs) - t0
    frames, samples = sum(r["frames"] for r in runs), sum(r["samples"] for r in runs)
    return {"requests": num, "wall_s": wall, "frames": frames,
            "rtf_at_12.5Hz": wall / (frames / FRAME_HZ), "rtf_tiny_samples": wall / (samples / runs[0]["sample_rate"]),
            "first_audio_med_ms": 1e3 * statistics.median(r["first_audio_s"] for r in runs)}


async def bench_pipeline(ckpt: str, process: str | None, rounds: int, sizes: list[int]) -> dict[str, Any]:
    coordinator = Coordinator(pipeline_config(ckpt, process))
    t0 = time.monotonic()
    await coordinator.start()
    start_s = time.monotonic() - t0
    try:
        await one_request(coordinator)  # warm-up: first calls allocate and fill caches
        singles = []
        for _ in range(4 * rounds):  # NOTE: first audio is ~15 ms and load noise ~5 ms: many replies
            await asyncio.sleep(0.05)  # NOTE: each reply arrives at an idle pipeline, as a user's turn does
            singles.append(await one_request(coordinator))
        loads = []
        for num in sizes:  # NOTE: the round of median wall time: one burst on a shared CPU is noisy
            bursts = sorted([await concurrent(coordinator, num) for _ in range(rounds)], key=lambda r: r["wall_s"])
            loads.append(bursts[len(bursts) // 2])
    finally:
        await coordinator.stop()
    return {"start_s": start_s, "singles": singles, "loads": loads}


@torch.no_grad()
def paged_step_times(talker: Any, num_seqs: int, num_frames: int) -> list[float]:
    """Per-step seconds of `step_paged` with `num_seqs` decode rows (after one batched prefill step)."""
    cfg, length, page_size = talker.cfg, bench_talker.PREFILL_LEN, 16
    pages_per_seq = (length + num_frames + page_size) // page_size
    cache = PagedKVCache(cfg.num_hidden_layers, num_seqs * pages_per_seq, page_size, cfg.num_key_value_heads,
                         cfg.head_dim, torch.float32)
    pages = [list(range(i * pages_per_seq, (i + 1) * pages_per_seq)) for i in range(num_seqs)]
    g = torch.Generator().manual_seed(1)
    prefill = torch.randn(num_seqs * length, cfg.hidden_size, generator=g)
    text = torch.randn(num_frames + 1, num_seqs, cfg.hidden_size, generator=g)
    seen = torch.zeros(num_seqs, cfg.vocab_size, dtype=torch.bool)
    ctx, pos = build_attention_context(cache, [(0, length, p) for p in pages], num_seqs * length)
    out = step_paged(talker, prefill, pos, ctx, torch.arange(1, num_seqs + 1) * length - 1, text[0], seen)
    rows, times = torch.arange(num_seqs), []
    for i in range(num_frames):
        t0 = time.perf_counter()  # NOTE: the context build is part of every serving step, so it is timed
        ctx, pos = build_attention_context(cache, [(length + i, 1, p) for p in pages], num_seqs)
        out = step_paged(talker, out.next_input_embeds, pos, ctx, rows, text[i + 1], seen)
        times.append(time.perf_counter() - t0)
    return times


def bench_step(num_frames: int, rounds: int, sizes: list[int]) -> list[dict[str, Any]]:
    reference = bench_talker.run(num_frames, rounds)  # Talker.step (1 sequence) and transformers per frame
    hf_ms = reference[1]["median_ms"]  # talker fwd + code_predictor.generate, as transformers' generate does
    talker, _ = bench_talker._build()
    rows = [{"impl": r["impl"], "S": 1, "step_ms": r["median_ms"], "ms_per_frame_per_seq": r["median_ms"],
             "x_faster_than_hf": hf_ms / r["median_ms"]} for r in reference]
    for num_seqs in sizes:
        paged_step_times(talker, num_seqs, 4)  # warm-up
        best = min((paged_step_times(talker, num_seqs, num_frames) for _ in range(rounds)), key=statistics.median)
        rows.append(step_row("ours: step_paged (batched)", num_seqs, best, hf_ms))
    # NOTE: the runner's decode-graph path (fixed-shape buffers); on a CPU, torch.compile stands in for
    # CUDA graph capture: both remove the per-op dispatch that dominates a tiny frame step.
    for is_compiled in (False, True):
        name = "ours: decode graph, torch.compile" if is_compiled else "ours: decode graph buffers, eager"
        for num_seqs in sizes:
            graphs = bench_gpu.make_graphs(talker, num_seqs, num_frames, torch.device("cpu"), is_compiled)
            best = min((bench_gpu.graph_step_times(graphs, num_seqs, num_frames) for _ in range(rounds)),
                       key=statistics.median)
            rows.append(step_row(name, num_seqs, best, hf_ms))
    return rows


def step_row(impl: str, num_seqs: int, times: list[float], hf_ms: float) -> dict[str, Any]:
    step_ms = 1e3 * statistics.median(times)
    return {"impl": impl, "S": num_seqs, "step_ms": step_ms, "ms_per_frame_per_seq": step_ms / num_seqs,
            "x_faster_than_hf": hf_ms * num_seqs / step_ms}


def median_of(runs: list[dict[str, Any]], key: str) -> float:
    return statistics.median(r[key] for r in runs)


def span(runs: list[dict[str, Any]], key: str) -> str:
    """One value, or `min-max` when the runs differ (a reply that ended early shows here)."""
    low, high = min(r[key] for r in runs), max(r[key] for r in runs)
    return str(low) if low == high else f"{low}-{high}"


def reply_rows(ref_runs: list[dict[str, Any]], results: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    rows = []
    for name, runs in [("transformers generate", ref_runs)] + [(k, v["singles"]) for k, v in results.items()]:
        rows.append({"impl": name, "text_tokens": span(runs, "tokens"), "frames": span(runs, "frames"),
                     "samples": span(runs, "samples"), "first_audio_ms": 1e3 * median_of(runs, "first_audio_s"),
                     "total_ms": 1e3 * median_of(runs, "total_s"),
                     "first_audio_x_sooner": median_of(ref_runs, "total_s") / median_of(runs, "first_audio_s")})
    return rows


def stage_rows(results: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    rows = []
    for name, res in results.items():
        row: dict[str, Any] = {"impl": name, "start_s": res["start_s"]}
        for stage in STAGES:
            row[f"{stage}_first_ms"] = 1e3 * statistics.median(r["stages"][stage] for r in res["singles"])
        rows.append(row)
    return rows


Rows = list[dict[str, Any]]


def goal_rows(replies: Rows, loads: Rows, steps: Rows) -> Rows:
    """The issue's goals against this run (ours = the default, one process per stage)."""
    ours = replies[1]
    load = max(loads, key=lambda r: r["requests"])
    paged = {(r["impl"], r["S"]): r for r in steps if r["impl"].startswith("ours: ") and "Talker.step" not in r["impl"]}
    rows = [
        {"goal": "first audio >= 10x sooner than transformers' generate",
         "ours": f"{ours['first_audio_ms']:.1f} ms vs {replies[0]['total_ms']:.1f} ms",
         "ratio": f"{ours['first_audio_x_sooner']:.1f}x", "met": ours["first_audio_x_sooner"] >= 10},
        {"goal": f"aggregate RTF < 0.5 at {load['requests']} requests (frames at 12.5 Hz)",
         "ours": f"{load['rtf_at_12.5Hz']:.3f}", "ratio": f"{0.5 / load['rtf_at_12.5Hz']:.1f}x under",
         "met": load["rtf_at_12.5Hz"] < 0.5},
    ]
    for (impl, num_seqs), row in paged.items():
        rows.append({"goal": f"Talker+MTP frame >= 5x faster than transformers per frame (S={num_seqs}), "
                             f"{impl.removeprefix('ours: ')}",
                     "ours": f"{row['ms_per_frame_per_seq']:.3f} ms/frame/seq",
                     "ratio": f"{row['x_faster_than_hf']:.1f}x", "met": row["x_faster_than_hf"] >= 5})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="1 round, concurrency 1,4 only, 16 step frames")
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    rounds = 1 if args.quick else args.rounds
    sizes = [1, 4] if args.quick else [1, 4, 16]
    torch.set_num_threads(1)
    print(cpu_description())
    with tempfile.TemporaryDirectory() as ckpt:
        ref = build_reference(ckpt)
        reference_turn(ref)  # warm-up
        ref_runs = [reference_turn(ref) for _ in range(4 * rounds)]
        results = {
            "ours: 4 processes": asyncio.run(bench_pipeline(ckpt, None, rounds, sizes)),
            "ours: 1 process (process: omni)": asyncio.run(bench_pipeline(ckpt, "omni", rounds, sizes)),
        }
    replies = reply_rows(ref_runs, results)
    print(f"\n== One reply: {TEXT_TOKENS} text tokens, {FRAMES} frames (4 s at 12.5 Hz), median of {4 * rounds} ==")
    print(format_table(replies))
    print("\n== First output of each stage after submit, ms (median, single requests) ==")
    print(format_table(stage_rows(results)))
    print(f"\n== Concurrent requests: RTF = wall / audio (goal < 0.5 at 16, at 12.5 Hz), median of {rounds} ==")
    print(format_table([{"impl": name, **load} for name, res in results.items() for load in res["loads"]]))
    steps = bench_step(16 if args.quick else 32, rounds, sizes)
    print(f"\n== Talker+MTP frame step alone, {16 if args.quick else 32} frames, best of {rounds} rounds ==")
    print(format_table(steps))
    print("\n== Goals ==")
    print(format_table(goal_rows(replies, results["ours: 4 processes"]["loads"], steps)))
    print("\n" + cpu_description())


if __name__ == "__main__":
    main()
