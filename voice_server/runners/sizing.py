"""Start-up sizing of an AR runner: how many KV pages fit its memory budget (the rows its steps are
padded to are `row_plan.py`'s)."""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

MIB = 1 << 20
BASE_RESERVE_BYTES = 96 * MIB
"""Activation headroom besides the per-token estimate: allocator slack, rope tables, sampling."""


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
