"""SmolLM2-135M-Instruct fp32 decode through `DecoderRunner` (paged cache) vs the contiguous loop.

Rows: the contiguous `KVCache` greedy loop (one sequence), then the runner with 1, 4 and 8
sequences decoding together (each prefilled first, not timed), batch-invariant (steps padded to the
probed row count) and not. Weights column-major, 1 thread, CPU. `--profile` prints the top ops
of one 8-sequence decode step.

Usage: OMP_NUM_THREADS=1 .venv/bin/python loadtest/bench_runner.py [--tokens 32] [--profile]
"""

from __future__ import annotations

import argparse
import os
import time
from typing import Any

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402

from voice_server.models.llama import load_gguf_with_tokenizer  # noqa: E402
from voice_server.models.llama.loader import find_smollm2_gguf  # noqa: E402
from voice_server.runners import DecoderRunner, DecoderRunnerConfig  # noqa: E402
from voice_server.scheduling.contract import ARBatch, ARSeq, SamplingParams  # noqa: E402

PROMPT = "Tell me a short story about a robot who learns to paint."


@torch.inference_mode()
def contiguous_tok_s(model: Any, ids: list[int], num_tokens: int) -> float:
    cache = model.make_kv_cache()
    logits = model(torch.tensor([ids]), torch.arange(len(ids))[None], cache, is_last_only=True)
    token = int(logits[0, -1].argmax())
    start = time.perf_counter()
    for step in range(num_tokens):
        pos = torch.tensor([[len(ids) + step]])
        token = int(model(torch.tensor([[token]]), pos, cache, is_last_only=True)[0, -1].argmax())
    return num_tokens / (time.perf_counter() - start)


def runner_tok_s(runner: DecoderRunner, ids: list[int], num_seqs: int, num_tokens: int, profile: bool) -> float:
    """Aggregate decode tokens/s of `num_seqs` sequences (prompts of different lengths)."""
    sp = SamplingParams()
    ps = runner.ar_spec.page_size
    max_len = len(ids) + num_seqs + num_tokens + 1
    pages_per_seq = -(-max_len // ps)
    seqs = []
    for i in range(num_seqs):
        prompt = ids[: len(ids) - i]
        pages = tuple(range(i * pages_per_seq, (i + 1) * pages_per_seq))
        out = runner.execute(ARBatch((ARSeq(f"s{i}", tuple(prompt), 0, pages, True, sp),)))
        seqs.append([f"s{i}", len(prompt), pages, out.outputs[0].token_id])

    def step() -> None:
        batch = ARBatch(tuple(ARSeq(rid, (tok,), pos, pages, True, sp) for rid, pos, pages, tok in seqs))
        for seq, out in zip(seqs, runner.execute(batch).outputs, strict=True):
            seq[1] += 1
            seq[3] = out.token_id

    step()
    start = time.perf_counter()
    for _ in range(num_tokens - 1):
        step()
    elapsed = time.perf_counter() - start
    if profile:
        from torch.profiler import ProfilerActivity
        from torch.profiler import profile as torch_profile

        with torch_profile(activities=[ProfilerActivity.CPU]) as prof:
            step()
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=14))
    for rid, *_ in seqs:
        runner.release(rid)
    return num_seqs * (num_tokens - 1) / elapsed


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--profile", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(1)
    model, tokenizer = load_gguf_with_tokenizer(find_smollm2_gguf())
    model.use_column_major_weights()
    ids = tokenizer.encode_chat([{"role": "user", "content": PROMPT}])
    print(f"prompt {len(ids)} tokens, {args.tokens} decode steps, fp32, column-major weights, 1 thread")
    print(f"contiguous KVCache loop, 1 seq: {contiguous_tok_s(model, ids, args.tokens):.1f} tok/s")
    for is_invariant in (True, False):
        config = DecoderRunnerConfig(budget_bytes=1 << 30, is_batch_invariant=is_invariant)
        runner = DecoderRunner(model, tokenizer, config)
        for num_seqs in (1, 4, 8):
            profile = args.profile and is_invariant and num_seqs == 8
            rate = runner_tok_s(runner, ids, num_seqs, args.tokens, profile)
            print(f"runner, batch_invariant={is_invariant} (steps of {runner.row_plan.describe()}), {num_seqs} seqs: "
                  f"{rate:.1f} tok/s aggregate, {rate / num_seqs:.1f} per seq")
        del runner


if __name__ == "__main__":
    main()
