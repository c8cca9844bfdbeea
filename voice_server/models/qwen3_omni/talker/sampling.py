"""Token selection for the talker (codebook 0) and the code predictor (codebooks 1..G-1).

The settings HF's `generate` gives each codebook, drawn through the shared processors of
`voice_server/models/sampling.py` in the same order: repetition penalty, suppressed ids, then (sampling
only) temperature, top-k, top-p.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from voice_server.models.sampling import multinomial, race, top_k_top_p_mask


@dataclass(frozen=True)
class CodebookSampling:
    """How one codebook's id is chosen (the request-level settings are `scheduling.contract.SamplingParams`)."""

    is_greedy: bool = True
    temperature: float = 1.0
    top_k: int = 0  # 0 = off
    top_p: float = 1.0  # 1.0 = off

    def __post_init__(self) -> None:
        if self.temperature <= 0:
            raise ValueError(f"CodebookSampling.temperature must be positive, got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"CodebookSampling.top_k must be >= 0, got {self.top_k}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"CodebookSampling.top_p must be in (0, 1], got {self.top_p}")


@dataclass(frozen=True)
class TalkerSampling:
    """Defaults equal transformers' `Qwen3OmniMoeForConditionalGeneration.generate(talker_do_sample=False)`.

    NOTE: repetition_penalty (1.05) and the control-id suppression are logits processors, so HF applies
    them in greedy decoding too; the code predictor gets neither.
    """

    code0: CodebookSampling = field(default_factory=CodebookSampling)
    residual: CodebookSampling = field(default_factory=CodebookSampling)
    repetition_penalty: float = 1.05
    is_suppress_control: bool = True

    def __post_init__(self) -> None:
        if self.repetition_penalty <= 0:
            raise ValueError(f"TalkerSampling.repetition_penalty must be positive, got {self.repetition_penalty}")

    @classmethod
    def hf_sampling(cls) -> TalkerSampling:
        """HF's sampling defaults: talker T=0.9, top-k 50; code predictor top-k 50, top-p 0.8."""
        return cls(
            code0=CodebookSampling(is_greedy=False, temperature=0.9, top_k=50, top_p=1.0),
            residual=CodebookSampling(is_greedy=False, temperature=1.0, top_k=50, top_p=0.8),
        )


def filter_scores(scores: torch.Tensor, params: CodebookSampling) -> torch.Tensor:
    """fp32 scores [B, V] -> temperature, top-k, then top-p applied (removed ids at -inf), HF's order."""
    if params.temperature != 1.0:
        scores = scores / params.temperature
    return top_k_top_p_mask(scores, [params.top_k], [params.top_p])


def select_tokens(
    logits: torch.Tensor, params: CodebookSampling, generator: torch.Generator | None = None
) -> torch.Tensor:
    """logits [B, V] (processed in fp32) -> ids [B], drawn as HF's `generate` draws (`multinomial`)."""
    scores = logits.float()
    if params.is_greedy:
        return scores.argmax(dim=-1)
    return multinomial(filter_scores(scores, params).softmax(dim=-1), generator)


def select_with_noise(logits: torch.Tensor, params: CodebookSampling, noise: torch.Tensor) -> torch.Tensor:
    """logits [B, V] -> ids [B], drawn with pre-drawn Exp(1) noise [B, V] (`race`): no generator call and
    no host sync, so it can run inside a CUDA graph; the caller draws the noise from each request's generator."""
    scores = logits.float()
    if params.is_greedy:
        return scores.argmax(dim=-1)
    return race(filter_scores(scores, params).softmax(dim=-1), noise)


def select_token_rows(
    logits: torch.Tensor, params: Sequence[CodebookSampling], generators: Sequence[torch.Generator | None]
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
