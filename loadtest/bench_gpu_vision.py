"""The released vision tower on a device (`loadtest/gpu_check.sh`): an image and a short video at the released
sizes, and a minute of video under the encoder stage's activation budget, with the formula's peak
(`voice_server/runners/vision_plan.py`) against the device's measured one.

Dummy weights of the released shapes (`load_part("vision", ..., load_format="dummy")`, bf16 by default), random
pixels of the grids the processor makes (16-pixel patches, 2 frames a temporal patch): the time of one forward
(after a warm-up, synchronised) and `torch.cuda.max_memory_allocated` above the weights, against the computed
peak. On a CPU it measures the live tensor bytes instead (`voice_server/runners/live_memory.py`) and takes long.

Usage: python loadtest/bench_gpu_vision.py [--device cuda] [--dtype bf16] [--budget-gib 4]
"""

from __future__ import annotations

import argparse
import time
from typing import Any

import numpy as np
import torch
from table import cpu_description, format_table

from voice_server.models.qwen3_omni.config import Qwen3OmniConfig
from voice_server.models.qwen3_omni.loading import load_part
from voice_server.models.qwen3_omni.vision.encoder import VisionEncoder
from voice_server.runners.live_memory import LiveTensorBytes
from voice_server.runners.vision_input import run_forward
from voice_server.runners.vision_plan import peak_activation_bytes, plan_forwards

MIB = 2**20
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
# (name, grid t x h x w in patches)
ITEMS = [("image 1024x768", (1, 48, 64)), ("image 448x448", (1, 28, 28)),
         ("video 4 s 448x448 at 2 fps", (4, 28, 28)), ("video 10 s 1024x768 at 2 fps", (10, 48, 64))]
MINUTE = (60, 48, 64)
"""A minute of 1024x768 video at 2 fps: 120 frames, 60 temporal patches."""


def pixels(grid: tuple[int, int, int], patch_dim: int) -> np.ndarray:
    t, h, w = grid
    return np.random.default_rng(0).standard_normal((t * h * w, patch_dim), dtype=np.float32)


def forward_peak(tower: VisionEncoder, pieces: list[tuple[np.ndarray, tuple[int, int, int]]]) -> tuple[int, float]:
    """(peak activation bytes above what was allocated before, seconds) of one forward."""
    device = next(tower.parameters()).device
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
        start = time.perf_counter()
        with torch.inference_mode():
            run_forward(tower, pieces)
        torch.cuda.synchronize(device)
        return torch.cuda.max_memory_allocated(device) - base, time.perf_counter() - start
    start = time.perf_counter()
    with torch.inference_mode(), LiveTensorBytes() as live:
        run_forward(tower, pieces)
    return live.peak_bytes, time.perf_counter() - start


def item_rows(tower: VisionEncoder, dtype_bytes: int) -> list[dict[str, Any]]:
    cfg = tower.cfg
    forward_peak(tower, [(pixels((1, 28, 28), cfg.patch_dim), (1, 28, 28))])  # NOTE: warm-up (kernels, allocator)
    rows = []
    for name, grid in ITEMS:
        t, h, w = grid
        measured, seconds = forward_peak(tower, [(pixels(grid, cfg.patch_dim), grid)])
        computed = peak_activation_bytes(cfg, dtype_bytes, t * h * w, h * w)
        rows.append({"item": name, "patches": t * h * w, "computed MiB": computed / MIB,
                     "measured MiB": measured / MIB, "computed / measured": computed / max(measured, 1),
                     "forward ms": 1000 * seconds})
    return rows


def budget_rows(tower: VisionEncoder, dtype_bytes: int, budget_gib: float) -> list[dict[str, Any]]:
    cfg = tower.cfg
    plan = plan_forwards([MINUTE], cfg, dtype_bytes, int(budget_gib * 2**30))
    video = pixels(MINUTE, cfg.patch_dim)
    frame = MINUTE[1] * MINUTE[2]
    rows = []
    for index, forward in enumerate(plan.forwards):
        (piece,) = forward
        grid = (piece.t_end - piece.t_start, MINUTE[1], MINUTE[2])
        measured, seconds = forward_peak(tower, [(video[piece.t_start * frame:piece.t_end * frame], grid)])
        rows.append({"forward": index, "temporal patches": grid[0], "budget MiB": budget_gib * 1024,
                     "computed MiB": peak_activation_bytes(cfg, dtype_bytes, grid[0] * frame, frame) / MIB,
                     "measured MiB": measured / MIB, "forward ms": 1000 * seconds})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", choices=tuple(DTYPES), default="bf16")
    parser.add_argument("--budget-gib", type=float, default=4.0)
    args = parser.parse_args()
    dtype = DTYPES[args.dtype]
    print(cpu_description())
    if args.device.startswith("cuda"):
        print(f"device: {torch.cuda.get_device_name(args.device)}")
    tower = load_part("vision", Qwen3OmniConfig(), load_format="dummy", dtype=dtype, device=args.device)
    assert isinstance(tower, VisionEncoder)
    print(f"\nThe released vision tower ({args.dtype}, depth {tower.cfg.depth}) on {args.device}: one forward")
    print(format_table(item_rows(tower, dtype.itemsize)))
    print(f"\nA minute of 1024x768 video at 2 fps under a {args.budget_gib:g} GiB activation budget")
    print(format_table(budget_rows(tower, dtype.itemsize, args.budget_gib)))


if __name__ == "__main__":
    main()
