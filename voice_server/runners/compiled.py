"""`CompiledDecodeStep`: single-stream decode through one AOTInductor-compiled graph.

A decode step of one sequence is ~1,900 small ops in eager mode (views, casts, norms, rope, the
per-layer paged attention); `PagedDecodeGraph` is that whole step (attention included, the number
of pages as the one dynamic dimension), exported and compiled ahead of time to C++ with the weights
as constants, so the host side of a step is one call.

NOTE: SmolLM2-135M int4, 1 thread, through `run_local` (64 tokens x 3 prompts, same process):
9.9-10.8 -> 7.0-7.8 ms per decode step (27-30%), the same greedy ids as eager. The logits are not
always bit-identical to `forward_paged` (the masked attention over whole pages rounds differently,
and the bf16 casts in front of the int4 kernels grow it: up to ~0.5 on a logit at a few kv
lengths), so a compiled runner is not batch invariant. Costs: ~30 s of compile at start-up, ~0.5 GB
more resident (SmolLM2; the weights again as constants of the compiled library, and what the
compile leaves). torch.compile of the per-layer dense parts only (attention eager in between, C++
wrapper) gave ~15%: dynamo guards, wrapper calls and 30 eager attention calls per step remain.
"""

from __future__ import annotations

import logging
import os
import tempfile
import time
from pathlib import Path

import torch
from torch.export import Dim, export

from voice_server.models.llama import LlamaForCausalLM
from voice_server.models.llama.model import PagedDecodeGraph
from voice_server.models.paged import AttentionContext, PagedKVCache

log = logging.getLogger(__name__)

# NOTE: read at import: inductor writes its default into the environment the first time it looks.
_USER_INDUCTOR_CACHE_DIR = os.environ.get("TORCHINDUCTOR_CACHE_DIR")


def inductor_cache_dir() -> Path:
    """Where the compile keeps inductor's cache (unless TORCHINDUCTOR_CACHE_DIR is set)."""
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "voice_server" / "inductor"


class CompiledDecodeStep:
    """Logits [1, V] of a step that is one decode row of one sequence, keys/values written to `cache`."""

    def __init__(self, model: LlamaForCausalLM, cache: PagedKVCache) -> None:
        from torch._inductor import aoti_compile_and_package, aoti_load_package

        os.environ["TORCHINDUCTOR_CACHE_DIR"] = _USER_INDUCTOR_CACHE_DIR or str(inductor_cache_dir())
        self.model, self.cache = model, cache
        device = cache.kv.device
        graph = PagedDecodeGraph(model, cache.page_size).eval()
        # NOTE: 2 pages in the example: a dimension traced at size 1 would be specialised.
        example = (
            torch.zeros(1, dtype=torch.long, device=device),
            torch.zeros(1, dtype=torch.long, device=device),
            torch.full((2,), cache.num_pages, dtype=torch.long, device=device),
            torch.tensor(2, dtype=torch.long, device=device),
            cache.kv,
        )
        pages = Dim("pages", min=1, max=cache.num_pages + 1)
        start = time.perf_counter()
        with torch.inference_mode():
            program = export(graph, example, dynamic_shapes=({}, {}, {0: pages}, {}, {}))
        with tempfile.TemporaryDirectory() as tmp:
            path = aoti_compile_and_package(program, package_path=str(Path(tmp) / "decode_step.pt2"))
            self.compiled = aoti_load_package(path)
        log.info("compiled the single-stream decode step in %.1f s", time.perf_counter() - start)
        self.slots = cache.kv.view(cache.num_layers, 2, -1, cache.num_kv_heads, cache.head_dim)

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: AttentionContext) -> torch.Tensor:
        """input_ids/positions [1] of a context with one span of one row."""
        (span,) = ctx.spans
        kv_len = torch.tensor(span.kv_len, dtype=torch.long, device=input_ids.device)
        hidden, new_kv = self.compiled(input_ids, positions, ctx.page_index, kv_len, self.cache.kv)
        self.slots.index_copy_(2, ctx.slot_mapping, new_kv[:, :, None])
        logits: torch.Tensor = self.model.lm_head(hidden)
        return logits
