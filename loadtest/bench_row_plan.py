"""Which row plan each quantization gets, and what batch invariance costs an fp32 decoder per way of
getting it, on three code paths of this machine.

Paths (a child process each: MKL and torch read these at load): MKL's default dispatch; `MKL_CBWR=COMPATIBLE`,
whose fp32 rows depend on the count past 8 as issue #18's Intel Xeon's did; and an AVX2-only machine
emulated (`ATEN_CPU_CAPABILITY=avx2 MKL_ENABLE_INSTRUCTIONS=AVX2 VOICE_SERVER_KERNEL_ISA=avx2`).

First table: the plan `DecoderRunner` probes for SmolLM2-135M-Instruct's layers (steps up to 512 rows) and
head (up to 8) under each quantization. Second: SmolLM2 fp32 (`quantization: none`), 1 thread, three ways:
- `as they come`: `batch_invariant: false`, no padding (not invariant where the BLAS rounds by row count);
- `probed padding`: the runner's `RowPlan` (at least N rows, a multiple of Q), what `batch_invariant: true` does;
- `8-row tiles`: every linear computes in GEMMs of exactly 8 rows (the last tile padded), the other
  candidate issue #18 names, here as a wrapper module around each linear.
Columns: decode tok/s of 1 and 8 streams, a 200-token prefill, each as a ratio to `as they come` in the same
process, and whether the way is batch invariant there (probed on the model's linears).

Usage: OMP_NUM_THREADS=1 .venv/bin/python loadtest/bench_row_plan.py [--tokens 32]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from typing import Any

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402
from bench_runner import runner_tok_s  # noqa: E402
from table import cpu_description, format_table  # noqa: E402
from torch import nn  # noqa: E402

from voice_server.models.llama import load_gguf_with_tokenizer, load_llama  # noqa: E402
from voice_server.models.llama.loader import find_smollm2_gguf  # noqa: E402
from voice_server.models.quant import LINEAR_TYPES  # noqa: E402
from voice_server.runners import DecoderRunner, DecoderRunnerConfig  # noqa: E402
from voice_server.runners.row_plan import RowPlan, probe_row_plan  # noqa: E402
from voice_server.scheduling.contract import ARBatch, ARSeq, SamplingParams  # noqa: E402

TILE = 8
PATHS = {"default": {}, "MKL_CBWR=COMPATIBLE": {"MKL_CBWR": "COMPATIBLE"},
         "AVX2-only": {"ATEN_CPU_CAPABILITY": "avx2", "MKL_ENABLE_INSTRUCTIONS": "AVX2",
                       "VOICE_SERVER_KERNEL_ISA": "avx2"}}
QUANTIZATIONS = ("none", "bf16", "int8", "int4", "w8a8", "w4a8")
PROMPT = "Tell me a long story about a robot who learns to paint, with every colour it tries. " * 8


class TiledLinear(nn.Module):
    """`inner` computed in GEMMs of exactly TILE rows: every row goes through the same kernel."""

    def __init__(self, inner: nn.Linear) -> None:
        super().__init__()
        self.inner, self.in_features = inner, inner.in_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features)
        n = flat.shape[0]
        padded = torch.nn.functional.pad(flat, (0, 0, 0, -n % TILE))
        out = torch.cat([self.inner(tile) for tile in padded.split(TILE)])[:n]
        return out.view(*x.shape[:-1], out.shape[-1])


def tile_linears(model: nn.Module) -> None:
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, nn.Linear):
                setattr(parent, name, TiledLinear(child))


def prefill_ms(runner: DecoderRunner, ids: list[int]) -> float:
    sp = SamplingParams()
    pages = tuple(range(-(-len(ids) // runner.ar_spec.page_size)))
    best = float("inf")
    for _ in range(3):
        start = time.perf_counter()
        runner.execute(ARBatch((ARSeq("p", tuple(ids), 0, pages, True, sp),)))
        best = min(best, time.perf_counter() - start)
        runner.release("p")
    return best * 1e3


def plans() -> list[dict[str, Any]]:
    """The plan a runner probes for each quantization (bf16: `quantization: none`, bf16 residual)."""
    from voice_server import kernels

    names = {v: k for k, v in kernels.IMPLS.items()}
    ours = names[kernels.best_impl()] if kernels.available() else "none"
    isa = f"torch {torch.backends.cpu.get_cpu_capability()}, ours {ours}"
    rows = []
    for name in QUANTIZATIONS:
        dtype = torch.bfloat16 if name == "bf16" else torch.float32
        quantization = "none" if name == "bf16" else name
        model = load_llama(find_smollm2_gguf(), dtype=dtype, quantization=quantization)
        start = time.perf_counter()
        runner = DecoderRunner(model, None, DecoderRunnerConfig(budget_bytes=2 << 30, max_step_tokens=512))
        rows.append({"vector paths": isa, "quantization": name, "layers": runner.row_plan.describe(),
                     "head": runner.head_plan.describe(), "runner start s": time.perf_counter() - start})
    return rows


def costs(num_tokens: int) -> list[dict[str, Any]]:
    rows = []
    for way in ("as they come", "probed padding", f"{TILE}-row tiles"):
        model, tokenizer = load_gguf_with_tokenizer(find_smollm2_gguf())
        if way.endswith("tiles"):
            tile_linears(model)
        config = DecoderRunnerConfig(budget_bytes=2 << 30, is_batch_invariant=way == "probed padding")
        runner = DecoderRunner(model, tokenizer, config)
        if way == "probed padding":
            is_invariant = runner.is_batch_invariant
        else:  # NOTE: as they come, rows are invariant only if the probe finds no padding needed
            kinds = TiledLinear if way.endswith("tiles") else LINEAR_TYPES
            linears = [m for m in model.modules() if isinstance(m, kinds)]
            is_invariant = probe_row_plan(linears, torch.float32, 512)[0] == RowPlan()
        ids = tokenizer.encode_chat([{"role": "user", "content": PROMPT}])[:200]
        rows.append({
            "way": way, "step rows (1 stream)": runner.row_plan.num_rows(1),
            "invariant": "yes" if is_invariant else "no",
            "plan": runner.row_plan.describe() if way == "probed padding" else "",
            "1 stream tok/s": runner_tok_s(runner, ids[:40], 1, num_tokens, False),
            "8 streams tok/s": runner_tok_s(runner, ids[:40], 8, num_tokens, False),
            "prefill 200 ms": prefill_ms(runner, ids),
        })
    return rows


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--child", action="store_true")
    args = parser.parse_args()
    if args.child:
        torch.set_num_threads(1)
        print(json.dumps({"plans": plans(), "costs": costs(args.tokens)}))
        return
    print(cpu_description())
    plan_table, cost_table = [], []
    for path, env in PATHS.items():
        done = subprocess.run([sys.executable, __file__, "--child", "--tokens", str(args.tokens)], check=True,
                              capture_output=True, text=True, env={**os.environ, **env})
        result = json.loads(done.stdout.strip().splitlines()[-1])
        plan_table.extend({"path": path, **row} for row in result["plans"])
        base = result["costs"][0]
        for row in result["costs"]:
            named = ("way", "plan", "invariant", "step rows (1 stream)")
            cost_table.append({"path": path, **{k: row[k] for k in named},
                               "1 stream tok/s": row["1 stream tok/s"],
                               "x": row["1 stream tok/s"] / base["1 stream tok/s"],
                               "8 streams tok/s": row["8 streams tok/s"],
                               "x ": row["8 streams tok/s"] / base["8 streams tok/s"],
                               "prefill 200 ms": row["prefill 200 ms"],
                               "x  ": row["prefill 200 ms"] / base["prefill 200 ms"]})
    print(format_table(plan_table))
    print()
    print(f"SmolLM2-135M-Instruct fp32, 1 thread, {args.tokens} decode steps; x: ratio to 'as they come' "
          "on the same path")
    print(format_table(cost_table))


if __name__ == "__main__":
    main()
