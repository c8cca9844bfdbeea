"""Start-up measurements of an AR runner: how many KV pages fit its memory budget, and from how
many rows on a step's matrix products give every row the same bits whatever the row count."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

MIB = 1 << 20
BASE_RESERVE_BYTES = 96 * MIB
"""Activation headroom besides the per-token estimate: allocator slack, rope tables, sampling."""
_PROBE_ROW_COUNTS = (1, 2, 3, 4, 5, 6, 7, 8, 16, 33, 64)


@dataclass(frozen=True)
class KVPlan:
    num_pages: int
    page_size: int
    max_model_len: int
    weight_bytes: int
    reserve_bytes: int
    kv_bytes: int

    def __post_init__(self) -> None:
        if self.num_pages < 1 or self.page_size < 1 or self.max_model_len < 2:
            raise ValueError(f"KVPlan: bad sizes {self}")

    @property
    def num_tokens(self) -> int:
        return self.num_pages * self.page_size


def weight_bytes(model: nn.Module) -> int:
    """Bytes of the model's parameters and buffers (tied weights counted once)."""
    tensors = {id(t): t for t in list(model.parameters()) + list(model.buffers())}
    return sum(t.numel() * t.element_size() for t in tensors.values())


def activation_reserve_bytes(
    max_step_tokens: int,
    max_num_seqs: int,
    hidden_size: int,
    intermediate_size: int,
    vocab_size: int,
    elem_size: int,
) -> int:
    """A generous bound on one step's live activations: a few hidden-size and MLP-size rows per token,
    and fp32 logits with sampling scratch (sort, probabilities, noise) per sampled sequence."""
    per_token = (8 * hidden_size + 3 * intermediate_size) * elem_size
    per_seq = 6 * 4 * vocab_size
    return BASE_RESERVE_BYTES + max_step_tokens * per_token + min(max_num_seqs, max_step_tokens) * per_seq


def plan_kv_cache(
    *,
    budget_bytes: int,
    weight_bytes: int,
    reserve_bytes: int,
    bytes_per_page: int,
    page_size: int,
    max_model_len: int,
) -> KVPlan:
    """Pages the budget holds after weights and reserve; `max_model_len` is capped by the cache."""
    kv_bytes = budget_bytes - weight_bytes - reserve_bytes
    num_pages = kv_bytes // bytes_per_page - 1  # NOTE: one scratch page for padding rows
    if num_pages < 1:
        raise ValueError(
            f"memory budget {budget_bytes / MIB:.0f} MiB holds no KV page: weights take "
            f"{weight_bytes / MIB:.0f} MiB and the activation reserve {reserve_bytes / MIB:.0f} MiB "
            f"(one page is {bytes_per_page / MIB:.2f} MiB); raise memory_fraction"
        )
    return KVPlan(
        num_pages=num_pages,
        page_size=page_size,
        max_model_len=min(max_model_len, num_pages * page_size),
        weight_bytes=weight_bytes,
        reserve_bytes=reserve_bytes,
        kv_bytes=(num_pages + 1) * bytes_per_page,
    )


@torch.no_grad()
def min_invariant_rows(modules: Iterable[nn.Module], in_dtype: torch.dtype, max_rows: int = 8) -> int:
    """Smallest row count from which every linear module gives each row the same bits for any row count.

    NOTE: BLAS picks kernels by the row count M. On the reference box (MKL 2024.2, AVX-512) fp32
    M=1 is a GEMV, M=2..3 one GEMM kernel and M>=4 another, each rounding differently (~1e-6);
    padding every step to this many rows makes a sequence's logits independent of its batch.
    Probed on the model's own modules (float or quantised: their kernels choose differently), since
    the choice may also depend on N and K.
    """
    worst = 1
    gen = torch.Generator().manual_seed(0)
    seen: set[tuple[Any, ...]] = set()
    for module in modules:
        tensors = list(module.parameters()) + list(module.buffers())
        in_features = getattr(module, "in_features", None)
        if not tensors or not isinstance(in_features, int):
            continue
        weight = max(tensors, key=lambda t: t.numel())
        key = (type(module), in_features, tuple(weight.shape), tuple(weight.stride()), weight.dtype)
        if key in seen:
            continue
        seen.add(key)
        x = torch.randn(max(_PROBE_ROW_COUNTS), in_features, generator=gen).to(weight.device, in_dtype)
        ref = module(x)
        agree = [m for m in _PROBE_ROW_COUNTS if torch.equal(module(x[:m]), ref[:m])]
        # The smallest m such that every probed count from m up agrees.
        first = max_rows + 1
        for m in reversed(_PROBE_ROW_COUNTS):
            if m not in agree:
                break
            first = m
        if first > max_rows:
            raise RuntimeError(f"rows of {type(module).__name__} depend on the row count beyond {max_rows} for {key}")
        worst = max(worst, first)
    return worst
