"""Prefix cache on SmolLM2-135M-Instruct (int4, the serving path): time to first token for
requests that share a long system prompt, cold (the cache off) vs warm (the prompt's full pages
cached by an earlier request with another question), side by side in one run.

Each row runs the same requests through `ARScheduler` + `DecoderRunner` (`runners.generate.run_local`):
one request per question, one after another. `ttft_ms` is admission to first token (prefill of
what the cache does not hold, plus one greedy token), `cached_tokens` what the cache served.

Usage: OMP_NUM_THREADS=1 .venv/bin/python loadtest/bench_prefix.py [--system-words 300] [--rounds 3]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from pathlib import Path
from typing import Any

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402

from voice_server.engine.local import LocalRequest, LocalStage  # noqa: E402
from voice_server.models.llama.gguf_file import GGUFFile  # noqa: E402
from voice_server.models.llama.gguf_quant import load_gguf_quantized  # noqa: E402
from voice_server.models.llama.loader import find_smollm2_gguf  # noqa: E402
from voice_server.models.llama.tokenizer import GGUFTokenizer  # noqa: E402
from voice_server.runners import DecoderRunner, DecoderRunnerConfig  # noqa: E402
from voice_server.runners.generate import budget_for  # noqa: E402
from voice_server.scheduling import ARScheduler  # noqa: E402

QUESTIONS = ("When is high tide?", "How do I trim a lamp wick?", "What birds nest on the cliffs?",
             "Is a storm coming tonight?")
_SYSTEM = ("You are Pim, the assistant of a lighthouse keeper on a remote northern island. You know the "
           "tides, the weather, the birds and every ship that passes. Answer in one short sentence. ")


def run(system_words: int, rounds: int) -> list[dict[str, Any]]:
    torch.set_num_threads(1)
    path = find_smollm2_gguf()
    gguf_file = GGUFFile(path)
    tokenizer = GGUFTokenizer.from_gguf_metadata(gguf_file.metadata)
    model = load_gguf_quantized(gguf_file, "int4")
    words = _SYSTEM.split()
    system = " ".join(words[i % len(words)] for i in range(system_words))
    prompts = [tokenizer.encode_chat([{"role": "system", "content": system}, {"role": "user", "content": q}])
               for q in QUESTIONS]
    runner = DecoderRunner(model, tokenizer, DecoderRunnerConfig(budget_bytes=budget_for(model, 4096)))
    rows = []
    for name, is_cached in (("cold (prefix_cache: false)", False), ("warm (prefix_cache: true)", True)):
        ttfts: list[float] = []
        cached: list[int] = []
        for _ in range(rounds):
            # NOTE: a fresh scheduler per round: the cache starts empty, the first question fills it.
            stage = LocalStage(ARScheduler(runner.ar_spec, 8, 512, prefix_cache=is_cached), runner)
            for i, ids in enumerate(prompts):
                sampling = {"max_tokens": 1}
                outcome = stage.run([LocalRequest(f"q{i}", {"token_ids": ids}, {"sampling": sampling})])[f"q{i}"]
                if i == 0:
                    continue  # NOTE: the first question pays for the prompt either way
                ttfts.append(1e3 * (outcome.first_emit_s or 0.0))
                cached.append(int(outcome.result["num_cached_tokens"]))
        rows.append({"prefix cache": name, "prompt_tokens": len(prompts[1]),
                     "cached_tokens": statistics.median(cached), "ttft_ms_median": statistics.median(ttfts),
                     "ttft_ms_min": min(ttfts)})
    rows[1]["speed-up"] = rows[0]["ttft_ms_median"] / rows[1]["ttft_ms_median"]
    return rows


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--system-words", type=int, default=300)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from table import cpu_description, format_table

    print(cpu_description())
    print(format_table(run(args.system_words, args.rounds)))


if __name__ == "__main__":
    main()
