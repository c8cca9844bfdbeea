"""GPU timings behind `loadtest/gpu_check.sh`: the Talker + MTP frame step, and first audio of a pipeline.

`talker`: one frame step (talker decode pass, code 0, the MTP's codes 1..G-1, the next input) at each
batch size, on dummy weights of a preset (`released`: the 30B-A3B talker sizes). `--cuda-graphs off`:
the reference `Talker.step` on a concatenating `KVCache` (eager); `on`: the serving runner's decode
path, `TalkerDecodeGraphs` over a paged cache (captured CUDA graphs on CUDA, the same fixed-shape
buffers run eagerly elsewhere).

`pipeline`: starts a pipeline config in real stage processes (optionally with every stage moved to
`--device` and its checkpoint replaced by `--preset` dummy weights), sends one text request, then
`--concurrency` at once, and prints each request's first text and first audio (ms after submit).

`--cuda-graphs on|off` also sets the talker stage's `cuda_graphs` in `pipeline` mode.

Usage: python loadtest/bench_gpu.py talker --preset released --device cuda --batches 1,16
       python loadtest/bench_gpu.py pipeline --config configs/qwen3-omni-30b-a3b.yaml --preset released
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from voice_server.config import pipeline_from_dict, plan_budget
from voice_server.config.loading import read_yaml
from voice_server.models.layers import KVCache
from voice_server.models.paged import PagedKVCache
from voice_server.models.qwen3_omni.config import Qwen3OmniConfig
from voice_server.models.qwen3_omni.loading import load_part
from voice_server.models.qwen3_omni.talker.model import Talker
from voice_server.models.qwen3_omni.talker.sampling import TalkerSampling
from voice_server.runners.talker_graphs import TalkerDecodeGraphs
from voice_server.scheduling.contract import ARSeq, SamplingParams
from voice_server.stages.omni_parts import PRESETS, preset_config

PREFILL_LEN = 12
_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@torch.no_grad()
def talker_step_times(talker: Talker, batch: int, num_steps: int, device: torch.device) -> list[float]:
    """Seconds per frame step at `batch` rows, after a prefill and 3 warm-up steps."""
    cfg, dtype = talker.cfg, next(talker.parameters()).dtype
    g = torch.Generator(device=device).manual_seed(batch)
    prefill = torch.randn(batch, PREFILL_LEN, cfg.hidden_size, generator=g, device=device, dtype=dtype)
    text = torch.randn(batch, cfg.hidden_size, generator=g, device=device, dtype=dtype)
    kv = KVCache(len(talker.model.layers))
    seen = torch.zeros(batch, cfg.vocab_size, dtype=torch.bool, device=device)
    positions = torch.arange(PREFILL_LEN, device=device)[None].expand(batch, -1)
    out = talker.step(prefill, positions, kv, text, seen)
    times = []
    for i in range(num_steps + 3):
        pos = torch.full((batch, 1), PREFILL_LEN + i, device=device)
        _sync(device)
        t0 = time.perf_counter()
        out = talker.step(out.next_input_embeds, pos, kv, text, seen)
        _sync(device)
        if i >= 3:
            times.append(time.perf_counter() - t0)
    return times


GRAPH_PAGE_SIZE = 16


def make_graphs(talker: Talker, batch: int, num_steps: int, device: torch.device,
                is_compiled: bool = False) -> TalkerDecodeGraphs:
    """The runner's decode path for one bucket of `batch` rows over a paged cache (captured on CUDA;
    `is_compiled`: torch.compile on a CPU, compiled here, ~20 s on the tiny config)."""
    cfg, dtype = talker.cfg, next(talker.parameters()).dtype
    max_len = PREFILL_LEN + num_steps + 8
    pages_per_seq = -(-max_len // GRAPH_PAGE_SIZE)
    cache = PagedKVCache(len(talker.model.layers), batch * pages_per_seq, GRAPH_PAGE_SIZE, cfg.num_key_value_heads,
                         cfg.head_dim, dtype, device)
    return TalkerDecodeGraphs(talker, cache, TalkerSampling(), max_len, buckets=(batch,), is_compiled=is_compiled)


@torch.no_grad()
def graph_step_times(graphs: TalkerDecodeGraphs, batch: int, num_steps: int) -> list[float]:
    """Seconds per decode step of `graphs` (from `make_graphs` with at least `num_steps`), `batch` rows."""
    talker, device = graphs.talker, graphs.cache.kv.device
    cfg, dtype = talker.cfg, graphs.cache.kv.dtype
    pages_per_seq = graphs.cache.num_pages // batch
    g = torch.Generator(device=device).manual_seed(batch)
    inputs = torch.randn(batch, cfg.hidden_size, generator=g, device=device, dtype=dtype)
    seen = torch.zeros(batch, cfg.vocab_size, dtype=torch.bool, device=device)
    tables = [tuple(range(b * pages_per_seq, (b + 1) * pages_per_seq)) for b in range(batch)]
    times = []
    for i in range(num_steps + 3):
        seqs = [ARSeq(str(b), (0,), PREFILL_LEN + i, tables[b], True, SamplingParams()) for b in range(batch)]
        _sync(device)
        t0 = time.perf_counter()
        _, inputs, seen = graphs.run(seqs, [s.start_pos for s in seqs], inputs, seen)
        _sync(device)
        if i >= 3:
            times.append(time.perf_counter() - t0)
    return times


def run_talker(args: argparse.Namespace) -> None:
    device = torch.device(args.device)
    cfg = preset_config(args.preset)
    t0 = time.perf_counter()
    talker = load_part("talker", cfg, load_format="dummy", dtype=_DTYPES[args.dtype], device=str(device))
    assert isinstance(talker, Talker)
    print(f"talker ({args.preset}, {args.dtype}, {device}): built in {time.perf_counter() - t0:.1f} s; "
          f"CUDA graphs: {args.cuda_graphs}")
    for batch in args.batches:
        if args.cuda_graphs == "on":
            times = graph_step_times(make_graphs(talker, batch, args.steps, device), batch, args.steps)
        else:
            times = talker_step_times(talker, batch, args.steps, device)
        median = statistics.median(times)
        print(f"  batch {batch:>3}: Talker+MTP step median {1e3 * median:7.2f} ms, mean "
              f"{1e3 * statistics.fmean(times):7.2f} ms, max {1e3 * max(times):7.2f} ms "
              f"-> {batch / median:8.1f} frames/s ({batch / median / 12.5:5.1f}x real time at 12.5 Hz)")


def derive_config(raw: dict[str, Any], device: str | None, preset: str | None, max_tokens: int,
                  max_frames: int, cuda_graphs: str = "auto") -> dict[str, Any]:
    """The config with every stage on `device` and on `preset` dummy weights (when given), short replies."""
    for stage in raw["stages"]:
        args = dict(stage.get("factory_args") or {})
        if device is not None:
            stage["device"] = device
        if preset is not None:
            args.pop("checkpoint", None)
            args["preset"] = preset
        if stage["factory"].endswith(":create_thinker"):
            args["sampling"] = {**(args.get("sampling") or {}), "max_tokens": max_tokens}
        if stage["factory"].endswith(":create_talker"):
            args["max_frames"] = max_frames
            args["cuda_graphs"] = cuda_graphs
        stage["factory_args"] = args
    return raw


def prompt_ids(cfg: Qwen3OmniConfig, num_text: int = 16) -> list[int]:
    """`<|im_start|>user\\n text <|im_end|>\\n<|im_start|>assistant\\n` in the model's vocabulary."""
    # NOTE: "\n" and plain text ids: Qwen's BPE (released) or the tiny preset's layout (presets.py).
    newline, first_text = (198, 1000) if cfg.thinker.text.vocab_size > 100_000 else (10, 20)
    head = [cfg.im_start_token_id, cfg.user_token_id, newline]
    tail = [cfg.im_end_token_id, newline, cfg.im_start_token_id, cfg.assistant_token_id, newline]
    return head + list(range(first_text, first_text + num_text)) + tail


async def _one(coordinator: Any, payload: dict[str, Any], first: dict[str, float]) -> dict[str, float]:
    """Fills `first` (stage -> ms to its first output) as outputs come, so a timed-out caller can say how far
    the request got."""
    async for out in coordinator.submit(payload, None):
        if out.stage not in first and out.payload:
            first[out.stage] = 1e3 * (out.timings.get(out.stage, time.monotonic()) - out.timings["submit"])
    return first


async def _batch(coordinator: Any, payload: dict[str, Any], n: int, timeout_s: float) -> list[dict[str, float]]:
    """`n` requests at once; past `timeout_s` an error naming the stages each request had heard from (a hang
    shows where it is, instead of using up the check's whole limit)."""
    firsts: list[dict[str, float]] = [{} for _ in range(n)]
    try:
        return await asyncio.wait_for(asyncio.gather(*(_one(coordinator, payload, f) for f in firsts)), timeout_s)
    except TimeoutError:
        reached = sorted({", ".join(f) or "none" for f in firsts})
        raise SystemExit(f"{n} requests did not finish in {timeout_s:g} s; the stages that answered: "
                         f"{' | '.join(reached)}") from None


async def _pipeline(cfg: Any, payload: dict[str, Any], concurrency: list[int], timeout_s: float) -> None:
    from voice_server.engine.coordinator import Coordinator

    coordinator = Coordinator(cfg)
    t0 = time.perf_counter()
    await coordinator.start()
    print(f"pipeline '{cfg.name}' ready in {time.perf_counter() - t0:.1f} s")
    try:
        for n in concurrency:
            results = await _batch(coordinator, payload, n, timeout_s)
            text = [r.get("thinker", float("nan")) for r in results]
            audio = [r.get("code2wav", float("nan")) for r in results]
            print(f"  {n:>3} concurrent: first text median {statistics.median(text):8.1f} ms, first audio "
                  f"median {statistics.median(audio):8.1f} ms, max {max(audio):8.1f} ms")
    finally:
        await coordinator.stop()


def run_pipeline(args: argparse.Namespace) -> None:
    raw = derive_config(read_yaml(Path(args.config)), args.device, args.preset, args.max_tokens, args.max_frames,
                        args.cuda_graphs)
    cfg = pipeline_from_dict(raw)
    plan_budget(cfg)
    thinker_args = next(s.factory_args for s in cfg.stages if s.factory.endswith(":create_thinker"))
    model = preset_config(thinker_args["preset"]) if "preset" in thinker_args else Qwen3OmniConfig.from_json_file(
        thinker_args["checkpoint"])
    print(f"CUDA graphs (talker decode steps): {args.cuda_graphs}")
    asyncio.run(_pipeline(cfg, {"token_ids": prompt_ids(model)}, [1, *args.concurrency], args.request_timeout))


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p_talker = sub.add_parser("talker", help="Talker+MTP frame step time per batch size")
    p_talker.add_argument("--preset", choices=PRESETS, default="released")
    p_talker.add_argument("--device", default="cuda")
    p_talker.add_argument("--dtype", choices=tuple(_DTYPES), default="bf16")
    p_talker.add_argument("--batches", type=_ints, default=[1, 16])
    p_talker.add_argument("--steps", type=int, default=32)
    p_pipe = sub.add_parser("pipeline", help="first text and first audio of a pipeline config")
    p_pipe.add_argument("--config", required=True)
    p_pipe.add_argument("--device", default=None, help="move every stage here (default: as configured)")
    p_pipe.add_argument("--preset", choices=PRESETS, default=None, help="dummy weights instead of the checkpoint")
    p_pipe.add_argument("--concurrency", type=_ints, default=[16], help="after one request alone")
    p_pipe.add_argument("--max-tokens", type=int, default=32)
    p_pipe.add_argument("--max-frames", type=int, default=64)
    p_pipe.add_argument("--request-timeout", type=float, default=60.0,
                        help="seconds a batch of requests may take before the run fails, naming where they got")
    for p in (p_talker, p_pipe):
        p.add_argument("--cuda-graphs", choices=("on", "off"), default="off")
    args = parser.parse_args()
    run_talker(args) if args.command == "talker" else run_pipeline(args)


if __name__ == "__main__":
    main()
