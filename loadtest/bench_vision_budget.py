"""The vision tower's activation memory: the encoder stage's formula (`voice_server/runners/vision_plan.py`)
against the peak of live tensor bytes measured during real forwards (`voice_server/runners/live_memory.py`),
and what a budget does to a minute of video.

First table: one forward of the released tower's widths (hidden 1152, MLP 4304, 16 heads, 2x2 merge, output
2048) at depth 3 with 3 DeepStack taps (the peak does not grow with depth: blocks run one after another;
the released 27 blocks tap 3), random weights, over images and videos of a few sizes, fp32 and bf16:
patches, frames, the largest frame's patches, the computed peak, the measured one and computed / measured.
Second table: a chunked run (a 16-frame 224x224 video, the budget fitting 4 frames): each forward's
computed and measured peak against the budget. Third: the released tower (bf16) on a minute of video at
the processor's largest frame (3072 patches) under budgets of 2 to 16 GiB: forwards, the largest
forward's computed peak, and the largest square image one forward takes.

Usage: OMP_NUM_THREADS=1 .venv/bin/python loadtest/bench_vision_budget.py [--dtypes fp32,bf16]
"""

from __future__ import annotations

import argparse
import math
import os
import time
from typing import Any

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402
from table import cpu_description, format_table  # noqa: E402

from voice_server.models.qwen3_omni.vision.config import VisionEncoderConfig  # noqa: E402
from voice_server.models.qwen3_omni.vision.encoder import VisionEncoder  # noqa: E402
from voice_server.runners.live_memory import LiveTensorBytes  # noqa: E402
from voice_server.runners.vision_input import run_forward  # noqa: E402
from voice_server.runners.vision_plan import peak_activation_bytes, plan_forwards  # noqa: E402

MIB, GIB = 2**20, 2**30
RELEASED = VisionEncoderConfig()
BENCH = VisionEncoderConfig(depth=3, deepstack_visual_indexes=(0, 1, 2))
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
# (name, grid t x h x w in patches): 16-pixel patches, 2 frames per temporal patch
ITEMS = [("image 224x224", (1, 14, 14)), ("image 448x448", (1, 28, 28)), ("image 896x896", (1, 56, 56)),
         ("video 8 frames 448x448", (4, 28, 28)), ("video 32 frames 224x224", (16, 14, 14))]


def measure(tower: VisionEncoder, grids: list[tuple[int, int, int]]) -> tuple[int, float]:
    g = torch.Generator().manual_seed(0)
    inputs = [(torch.randn(t * h * w, tower.cfg.patch_dim, generator=g).numpy(), (t, h, w)) for t, h, w in grids]
    start = time.perf_counter()
    with torch.inference_mode(), LiveTensorBytes() as live:
        run_forward(tower, inputs)
    return live.peak_bytes, time.perf_counter() - start


def formula_rows(dtypes: list[str]) -> list[dict[str, Any]]:
    rows = []
    for name in dtypes:
        torch.manual_seed(0)
        tower = VisionEncoder(BENCH).to(DTYPES[name]).eval()
        for item, (t, h, w) in ITEMS:
            measured, seconds = measure(tower, [(t, h, w)])
            computed = peak_activation_bytes(BENCH, DTYPES[name].itemsize, t * h * w, h * w)
            rows.append({"item": item, "dtype": name, "patches": t * h * w, "frames": t, "frame patches": h * w,
                         "computed MiB": computed / MIB, "measured MiB": measured / MIB,
                         "computed / measured": computed / measured, "forward s": seconds})
    return rows


def chunked_rows() -> list[dict[str, Any]]:
    torch.manual_seed(0)
    tower = VisionEncoder(BENCH).eval()
    grid = (16, 14, 14)
    frame = grid[1] * grid[2]
    budget = peak_activation_bytes(BENCH, 4, 4 * frame, frame)
    plan = plan_forwards([grid], BENCH, 4, budget)
    rows = []
    for pieces in plan.forwards:
        (piece,) = pieces
        frames = piece.t_end - piece.t_start
        measured, _ = measure(tower, [(frames, grid[1], grid[2])])
        computed = peak_activation_bytes(BENCH, 4, frames * frame, frame)
        rows.append({"forward frames": f"{piece.t_start}..{piece.t_end - 1}", "budget MiB": budget / MIB,
                     "computed MiB": computed / MIB, "measured MiB": measured / MIB,
                     "measured / budget": measured / budget})
    return rows


def largest_square_image(budget: int) -> int:
    """The side in pixels of the largest square image one bf16 forward of the released tower takes."""
    side = 1
    while peak_activation_bytes(RELEASED, 2, (side + 1) ** 2, (side + 1) ** 2) <= budget:
        side += 1
    return side * RELEASED.patch_size


def budget_rows() -> list[dict[str, Any]]:
    grid = (60, 64, 48)  # NOTE: 120 frames at 2 fps, 1024x768 (the video processor's largest, 3072 patches)
    one = peak_activation_bytes(RELEASED, 2, math.prod(grid), grid[1] * grid[2])
    rows = [{"budget GiB": "none", "forwards": 1, "largest forward GiB": one / GIB, "largest image px": ""}]
    for gib in (2, 4, 8, 16):
        plan = plan_forwards([grid], RELEASED, 2, gib * GIB)
        peaks = [peak_activation_bytes(RELEASED, 2, sum((p.t_end - p.t_start) * 3072 for p in f), 3072)
                 for f in plan.forwards]
        rows.append({"budget GiB": gib, "forwards": len(plan.forwards), "largest forward GiB": max(peaks) / GIB,
                     "largest image px": largest_square_image(gib * GIB)})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dtypes", default="fp32,bf16", help="comma-separated: fp32, bf16")
    args = parser.parse_args()
    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    print(cpu_description())
    print("\nOne forward, released widths at depth 3: computed vs measured peak of live tensor bytes")
    print(format_table(formula_rows([d for d in args.dtypes.split(",") if d])))
    print("\nA 32-frame 224x224 video (16 temporal patches) chunked to a budget of 4 frames (fp32)")
    print(format_table(chunked_rows()))
    print("\nThe released tower (bf16, depth 27): a minute of video at 1024x768, 2 fps, under a budget")
    print(format_table(budget_rows()))


if __name__ == "__main__":
    main()
