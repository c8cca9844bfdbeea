"""Token selection for the talker (codebook 0) and the code predictor (codebooks 1..G-1).

Mirrors the transformers logits processors `generate` installs, in the same order: repetition
penalty, suppressed ids, then (sampling only) temperature, top-k, top-p.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch


@dataclass(frozen=True)
class SamplingParams:
    is_greedy: bool = True
    temperature: float = 1.0
    top_k: int = 0  # 0 = off
    top_p: float = 1.0  # 1.0 = off

    def __post_init__(self) -> None:
        if self.temperature <= 0:
            raise ValueError(f"SamplingParams.temperature must be positive, got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"SamplingParams.top_k must be >= 0, got {self.top_k}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"SamplingParams.top_p must be in (0, 1], got {self.top_p}")


@dataclass(frozen=True)
class TalkerSampling:
    """Defaults equal transformers' `Qwen3OmniMoeForConditionalGeneration.generate(talker_do_sample=False)`.

    NOTE: repetition_penalty (1.05) and the control-id suppression are logits processors, so HF applies
    them in greedy decoding too; the code predictor gets neither.
    """

    code0: SamplingParams = field(default_factory=SamplingParams)
    residual: SamplingParams = field(default_factory=SamplingParams)
    repetition_penalty: float = 1.05
    is_suppress_control: bool = True

    def __post_init__(self) -> None:
        if self.repetition_penalty <= 0:
            raise ValueError(f"TalkerSampling.repetition_penalty must be positive, got {self.repetition_penalty}")

    @classmethod
    def hf_sampling(cls) -> TalkerSampling:
        """HF's sampling defaults: talker T=0.9, top-k 50; code predictor top-k 50, top-p 0.8."""
        return cls(
            code0=SamplingParams(is_greedy=False, temperature=0.9, top_k=50, top_p=1.0),
            residual=SamplingParams(is_greedy=False, temperature=1.0, top_k=50, top_p=0.8),
        )


def apply_repetition_penalty(logits: torch.Tensor, seen: torch.Tensor, penalty: float | torch.Tensor) -> torch.Tensor:
    """logits [B, V]; seen [B, V] bool marks ids already generated; penalty one value or per row [B, 1]."""
    if isinstance(penalty, float) and penalty == 1.0:
        return logits
    penalized = torch.where(logits < 0, logits * penalty, logits / penalty)
    return torch.where(seen, penalized, logits)


def filter_scores(scores: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """fp32 scores [B, V] -> temperature, top-k, then top-p applied (removed ids at -inf), HF's order."""
    if params.temperature != 1.0:
        scores = scores / params.temperature
    if 0 < params.top_k < scores.shape[-1]:
        kth = torch.topk(scores, params.top_k, dim=-1).values[..., -1:]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_scores, sorted_idx = torch.sort(scores, descending=False)
        cum_probs = sorted_scores.softmax(dim=-1).cumsum(dim=-1)
        drop = cum_probs <= (1 - params.top_p)
        drop[..., -1:] = False  # keep at least the most likely id
        scores = scores.masked_fill(drop.scatter(-1, sorted_idx, drop), float("-inf"))
    return scores


def select_tokens(
    logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None = None
) -> torch.Tensor:
    """logits [B, V] (processed in fp32) -> ids [B]."""
    scores = logits.float()
    if params.is_greedy:
        return scores.argmax(dim=-1)
    probs = filter_scores(scores, params).softmax(dim=-1)
    return torch.multinomial(probs, num_samples=1, generator=generator).squeeze(-1)


def select_with_noise(logits: torch.Tensor, params: SamplingParams, noise: torch.Tensor) -> torch.Tensor:
    """logits [B, V] -> ids [B], drawn with pre-drawn Exp(1) noise [B, V]: argmax(probs / noise) picks
    id i with probability probs[i] (the exponential race), with no generator call and no host sync,
    so it can run inside a CUDA graph; the caller draws the noise from each request's generator."""
    scores = logits.float()
    if params.is_greedy:
        return scores.argmax(dim=-1)
    probs = filter_scores(scores, params).softmax(dim=-1)
    return (probs / noise).argmax(dim=-1)


def select_token_rows(
    logits: torch.Tensor, params: Sequence[SamplingParams], generators: Sequence[torch.Generator | None]
) -> torch.Tensor:
    """logits [S, V] -> ids [S], row i chosen with its own `params[i]` and `generators[i]`.

    NOTE: all-greedy rows take one argmax (no host sync, no per-row ops); otherwise each row is
    selected alone, so a row draws from its own generator exactly as `select_tokens` on [1, V] does.
    """
    if not len(params) == len(generators) == logits.shape[0]:
        raise ValueError(f"{logits.shape[0]} rows, {len(params)} sampling params, {len(generators)} generators")
    if all(p.is_greedy for p in params):
        return logits.float().argmax(dim=-1)
    return torch.cat(
        [select_tokens(logits[i : i + 1], p, g) for i, (p, g) in enumerate(zip(params, generators, strict=True))]
    )
