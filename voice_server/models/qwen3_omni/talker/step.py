"""The talker's frame step for S sequences at once over the paged cache (the serving runner's step).

One talker pass over the flat rows of a ragged batch (prefill chunks and decode rows together), then,
at each sampling sequence's last row: code 0 (per-row sampling and repetition-penalty state), the
code predictor's fill of codes 1..G-1 batched over the S rows, and the next talker input (sum of the G
codebook embeddings + the row's text vector). `Talker.step` is the one-sequence reference it matches.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from voice_server.models.paged import PagedAttention
from voice_server.models.qwen3_omni.talker.model import Talker
from voice_server.models.qwen3_omni.talker.sampling import TalkerSampling, select_token_rows, select_with_noise
from voice_server.models.sampling import penalize_seen, per_row
from voice_server.models.shapes import FLOATING, expect_shapes


@dataclass(frozen=True)
class FrameNoise:
    """Pre-drawn Exp(1) noise for one sampled frame per row (`select_with_noise`): code 0 [S, V] and
    codes 1..G-1 [S, G-1, codebook]. Drawn outside the step from each request's generator, so a
    sampled step has no generator call inside and can be captured in a CUDA graph."""

    code0: torch.Tensor
    residual: torch.Tensor

    @classmethod
    def draw(cls, talker: Talker, generators: Sequence[torch.Generator], device: torch.device) -> FrameNoise:
        cfg = talker.cfg
        code0 = torch.empty(len(generators), cfg.vocab_size, device=device)
        residual = torch.empty(len(generators), cfg.num_code_groups - 1, cfg.code_predictor.vocab_size, device=device)
        for row, generator in enumerate(generators):
            # NOTE: per row from its own generator, code 0 first: a request's draws never depend on its batch.
            code0[row].exponential_(generator=generator)
            residual[row].exponential_(generator=generator)
        return cls(code0, residual)


@dataclass(frozen=True)
class TalkerPagedStep:
    codes: torch.Tensor  # [S, G]: code 0 from codec_head, codes 1..G-1 from the code predictor
    next_input_embeds: torch.Tensor  # [S, H]: each sequence's talker input row of its next step
    hidden: torch.Tensor  # [S, H]: post-norm talker hidden at each sequence's last row
    logits: torch.Tensor  # [S, V]: raw codec_head logits there


def select_code0_rows(
    talker: Talker,
    logits: torch.Tensor,
    code0_seen: torch.Tensor | None,
    samplings: Sequence[TalkerSampling],
    generators: Sequence[torch.Generator | None],
    noise: torch.Tensor | None = None,
) -> torch.Tensor:
    """`Talker.select_code0` with per-row settings: raw logits [S, V] -> code 0 [S]; marks the choice
    in `code0_seen` [S, V] in place. With `noise` [S, V] every row uses `samplings[0]` and draws
    through `select_with_noise`."""
    scores = logits.float()
    if code0_seen is not None:
        scores = penalize_seen(scores, code0_seen, per_row([s.repetition_penalty for s in samplings], scores))
    is_suppress = [s.is_suppress_control for s in samplings]
    if any(is_suppress):
        mask = talker.suppress_mask(scores.device)
        if not all(is_suppress):
            mask = mask[None] & torch.tensor(is_suppress, device=scores.device)[:, None]
        scores = scores.masked_fill(mask, float("-inf"))
    if noise is not None:
        code0 = select_with_noise(scores, samplings[0].code0, noise)
    else:
        code0 = select_token_rows(scores, [s.code0 for s in samplings], generators)
    if code0_seen is not None:
        code0_seen.scatter_(1, code0[:, None], True)
    return code0


def step_paged(
    talker: Talker,
    inputs_embeds: torch.Tensor,
    positions: torch.Tensor,
    ctx: PagedAttention,
    logits_indices: torch.Tensor,
    text_vec: torch.Tensor,
    code0_seen: torch.Tensor | None = None,
    samplings: Sequence[TalkerSampling] | None = None,
    generators: Sequence[torch.Generator | None] | None = None,
    noise: FrameNoise | None = None,
) -> TalkerPagedStep:
    """Frame step of S sequences: flat inputs_embeds [T, H] and positions [T] | [3, T] of the step's
    rows (as `Talker.forward_paged`), logits_indices [S] the last row of each sequence that completes
    a frame this step (a sequence still mid-prefill has rows but no index), text_vec [S, H] the text
    vector each adds to its next input.

    `code0_seen` [S, V] bool: the rows' repetition-penalty history, updated in place (a runner keeping
    per-sequence rows elsewhere gathers them and writes them back). `samplings` / `generators`: one per
    row (default greedy `TalkerSampling()` and no generator). A row whose code 0 is codec EOS has ended:
    its frame is to be dropped (HF never fills it). `noise`: rows that share one sampling draw with
    pre-drawn noise instead of generators (what a CUDA graph of the step replays).
    """
    dims = expect_shapes(
        ("logits_indices", logits_indices, "[S]", torch.long), ("text_vec", text_vec, "[S, H]", FLOATING),
        ("code0_seen", code0_seen, "[S, V]", torch.bool),
        dims={"H": talker.cfg.hidden_size, "V": talker.cfg.vocab_size},
    )
    num_seqs = dims["S"]
    samplings = [TalkerSampling()] * num_seqs if samplings is None else samplings
    generators = [None] * num_seqs if generators is None else generators
    if not len(samplings) == len(generators) == num_seqs:
        raise ValueError(f"{num_seqs} sequences, {len(samplings)} samplings, {len(generators)} generators")
    logits, hidden = talker.forward_paged(inputs_embeds, positions, ctx, logits_indices)
    if noise is not None and any(s != samplings[0] for s in samplings):
        raise ValueError("pre-drawn noise needs one sampling for every row")
    code0 = select_code0_rows(talker, logits, code0_seen, samplings, generators,
                              None if noise is None else noise.code0)
    code0_embed = talker.model.codec_embedding(code0)
    if noise is None:
        fill = talker.code_predictor.fill_rows(hidden, code0_embed, [s.residual for s in samplings], generators)
    else:
        fill = talker.code_predictor.fill_with_noise(hidden, code0_embed, samplings[0].residual, noise.residual)
    # NOTE: the same sum as `Talker.step` (code 0's embedding first, then codes 1..G-1 in order).
    codec_sum = torch.cat((code0_embed.unsqueeze(1), fill.embeds), dim=1).sum(1)
    next_input = codec_sum + text_vec.to(codec_sum.dtype)
    codes = torch.cat((code0.unsqueeze(1), fill.codes), dim=1)
    return TalkerPagedStep(codes, next_input, hidden, logits)
