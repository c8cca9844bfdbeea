"""Offline generation through the serving path: a `DecoderRunner` under an `ARScheduler`, stepped
in this process by `LocalStage`. This is the one generation loop (benchmarks, reference checks and
offline use go through it, so they measure and verify what the server runs)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from voice_server.engine.local import LocalOutcome, LocalRequest, LocalStage
from voice_server.models.llama import LlamaForCausalLM
from voice_server.models.paged import PagedKVCache, build_attention_context
from voice_server.runners.ar_config import DecoderRunnerConfig, kv_cache_dtype_for
from voice_server.runners.ar_runner import DecoderRunner
from voice_server.runners.sizing import activation_reserve_bytes, weight_bytes
from voice_server.scheduling import ARScheduler


def budget_for(model: LlamaForCausalLM, num_tokens: int, page_size: int = 16, max_step_tokens: int = 512,
               max_num_seqs: int = 8) -> int:
    """A memory budget that holds the weights, the activation reserve and `num_tokens` of KV cache."""
    cfg = model.config
    residual = model.model.norm.weight
    kv_dtype = kv_cache_dtype_for(model, residual.dtype, residual.device)  # NOTE: as the runner's KV cache
    elem = residual.element_size()
    reserve = activation_reserve_bytes(max_step_tokens, max_num_seqs, cfg.hidden_size, cfg.intermediate_size,
                                       cfg.vocab_size, elem)
    per_page = PagedKVCache.bytes_per_page(cfg.num_hidden_layers, page_size, cfg.num_key_value_heads,
                                           cfg.head_dim, kv_dtype)
    num_pages = -(-num_tokens // page_size) + 2  # NOTE: + the scratch page, + slack for rounding
    return weight_bytes(model) + reserve + num_pages * per_page


def run_local(runner: DecoderRunner, requests: Sequence[LocalRequest], max_batch_size: int = 8,
              max_step_tokens: int = 512) -> dict[str, LocalOutcome]:
    """Run `requests` through an `ARScheduler` over `runner`'s KV cache, as the `ar` stage does."""
    scheduler = ARScheduler(runner.ar_spec, max_batch_size, max_step_tokens)
    return LocalStage(scheduler, runner).run(requests)


def generate_greedy(
    model: LlamaForCausalLM, input_ids: Sequence[int], max_new_tokens: int, eos_ids: Sequence[int] = (),
) -> list[int]:
    """New token ids (prompt excluded) for one sequence; stops after the first of `eos_ids`."""
    if max_new_tokens <= 0:
        raise ValueError(f"max_new_tokens must be > 0, got {max_new_tokens}")
    ids = [int(t) for t in input_ids]
    if not ids:
        raise ValueError("input_ids must not be empty")
    budget = budget_for(model, len(ids) + max_new_tokens)
    runner = DecoderRunner(model, None, DecoderRunnerConfig(budget_bytes=budget))
    sampling: dict[str, Any] = {"max_tokens": max_new_tokens, "ignore_eos": True, "stop_token_ids": list(eos_ids)}
    outcome = run_local(runner, [LocalRequest("greedy", {"token_ids": ids}, {"sampling": sampling})])["greedy"]
    return list(outcome.result["token_ids"])


def forced_next_ids(model: LlamaForCausalLM, input_ids: Sequence[int], tokens: Sequence[int],
                    page_size: int = 16) -> list[int]:
    """Teacher forcing: the argmax after the prompt and after each of `tokens[:-1]` appended, from one
    paged prefill of prompt + tokens[:-1] (the forward the runner runs). Against another model's
    greedy `tokens` it scores numerics position by position: one near-tie flip costs one position,
    not the rest of the sequence as in free-running greedy agreement."""
    if not input_ids or not tokens:
        raise ValueError("input_ids and tokens must not be empty")
    ids = [int(t) for t in input_ids] + [int(t) for t in tokens[:-1]]
    cfg = model.config
    num_pages = -(-len(ids) // page_size)
    residual = model.model.norm.weight
    cache = PagedKVCache(cfg.num_hidden_layers, num_pages, page_size, cfg.num_key_value_heads, cfg.head_dim,
                         kv_cache_dtype_for(model, residual.dtype, residual.device), residual.device)
    ctx, positions = build_attention_context(cache, [(0, len(ids), list(range(num_pages)))], len(ids))
    rows = torch.arange(len(input_ids) - 1, len(ids))
    with torch.no_grad():
        logits = model.forward_paged(torch.tensor(ids), positions, ctx, rows)
    return [int(t) for t in logits.argmax(-1).tolist()]
