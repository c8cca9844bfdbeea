"""Choosing a token from logits: transformers' logits processors and the two draws, in one place.

Processors run in `generate`'s order and with its arithmetic (repetition penalty, then temperature, top-k,
top-p), so a distribution here is bit-identical to HF's and a seeded multinomial draw lines up with it.
Two callers share them: the runners' `Sampler` (per-request settings and generators over a batch) and the
talker (one setting per codebook, drawing with pre-drawn noise inside a CUDA graph). A setting shared by
all rows stays a Python scalar, so nothing is copied to the device per step.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def penalize(scores: torch.Tensor, penalty: float | torch.Tensor) -> torch.Tensor:
    """HF's repetition penalty rule on the scores of seen ids: positive ones divided, negative ones multiplied."""
    return torch.where(scores < 0, scores * penalty, scores / penalty)


def penalize_seen(logits: torch.Tensor, seen: torch.Tensor, penalty: float | torch.Tensor) -> torch.Tensor:
    """logits [B, V]; seen [B, V] bool marks ids already generated; penalty one value or per row [B, 1]."""
    if isinstance(penalty, float) and penalty == 1.0:
        return logits
    return torch.where(seen, penalize(logits, penalty), logits)


def penalize_histories(
    logits: torch.Tensor, histories: Sequence[Sequence[int]], penalties: Sequence[float]
) -> torch.Tensor:
    """In place on logits [S, V]: `penalize` every id of each row's history (prompt and output ids, as
    HF's `RepetitionPenaltyLogitsProcessor`). Rows with penalty 1 or no history are untouched."""
    rows = [i for i, (h, p) in enumerate(zip(histories, penalties, strict=True)) if p != 1.0 and h]
    if not rows:
        return logits
    max_len = max(len(histories[i]) for i in rows)
    # NOTE: pad with the row's own first id: a repeated index scatters the same value twice.
    ids = torch.tensor(
        [list(histories[i]) + [histories[i][0]] * (max_len - len(histories[i])) for i in rows],
        dtype=torch.long,
        device=logits.device,
    )
    row_index = torch.tensor(rows, dtype=torch.long, device=logits.device)
    penalty = torch.tensor([penalties[i] for i in rows], dtype=logits.dtype, device=logits.device)[:, None]
    sub = logits.index_select(0, row_index)
    logits.index_copy_(0, row_index, sub.scatter(1, ids, penalize(sub.gather(1, ids), penalty)))
    return logits


def per_row(values: Sequence[float], like: torch.Tensor) -> float | torch.Tensor:
    """One value when every row shares it (a Python scalar: nothing copied to the device per step, so a
    CUDA graph can capture it), else [S, 1] in `like`'s dtype and device."""
    if len(set(values)) == 1:
        return float(values[0])
    return torch.tensor(list(values), dtype=like.dtype, device=like.device)[:, None]


def top_k_top_p_mask(scores: torch.Tensor, top_ks: Sequence[int], top_ps: Sequence[float]) -> torch.Tensor:
    """scores [S, V] (already divided by the temperature) -> a copy with -inf outside each row's top-k
    (0 = off) and then outside its top-p nucleus (1 = off): HF's `TopKLogitsWarper` then `TopPLogitsWarper`
    per row (`top_ks`, `top_ps`: one per row, or one shared by all)."""
    vocab_size = scores.shape[1]
    ks = [k if 0 < k < vocab_size else vocab_size for k in top_ks]
    if min(ks) < vocab_size:
        max_k = max(ks)
        top = torch.topk(scores, max_k, dim=-1).values
        if len(set(ks)) == 1:
            kth: torch.Tensor = top[:, max_k - 1 :]
        else:
            # NOTE: an off row (k = V) keeps every id: its threshold is -inf, one column past the top-k.
            top = torch.cat([top, torch.full_like(top[:, :1], float("-inf"))], dim=-1)
            index = [k - 1 if k < vocab_size else max_k for k in ks]
            kth = top.gather(1, torch.tensor(index, device=scores.device)[:, None])
        # NOTE: HF keeps every id scoring at least the k-th (ties at the boundary survive).
        scores = scores.masked_fill(scores < kth, float("-inf"))
    if any(p < 1.0 for p in top_ps):
        # NOTE: HF's arithmetic: ascending sort, drop the least likely ids while their cumulative mass stays
        # at or under 1 - top_p (computed in Python, as HF does), always keep the most likely. An off row
        # (top_p 1) compares with -1: a float cumsum over its zero-probability tail must drop nothing.
        floor = per_row([1 - p if p < 1.0 else -1.0 for p in top_ps], scores)
        sorted_scores, sorted_ids = torch.sort(scores, descending=False)
        drop = sorted_scores.softmax(dim=-1).cumsum(dim=-1) <= floor
        drop[..., -1:] = False
        scores = scores.masked_fill(drop.scatter(-1, sorted_ids, drop), float("-inf"))
    return scores


def race(probs: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    """probs [S, V], Exp(1) noise [S, V] -> ids [S]: argmax(probs / noise) picks id i with probability
    probs[i] (the exponential race): no generator call and no host sync, so it can run in a CUDA graph."""
    # NOTE: an exact 0 drawn as noise must not give inf / nan rows; not in place: noise may be a graph input.
    return (probs / noise.clamp_min(torch.finfo(noise.dtype).tiny)).argmax(dim=-1)


def multinomial(probs: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """probs [S, V] -> ids [S] with `torch.multinomial`, HF `generate`'s own draw: seeded alike, the
    ids are HF's (what the reference-mirroring paths use; serving draws with `race`)."""
    return torch.multinomial(probs, num_samples=1, generator=generator).squeeze(-1)
