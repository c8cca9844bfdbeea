"""Token sampling for a batch of sequences, vectorised over the batch.

Order and semantics follow transformers: repetition penalty (over prompt and output ids), then for
sampling rows temperature, top-k, top-p. Greedy rows take the argmax of the penalised logits.
Each request draws from its own `torch.Generator` (seeded from `SamplingParams.seed`), so a seeded
request gives the same tokens whatever else is in the batch. `draw` advances no state: a step keeps
its draws with `commit` once it succeeded, so a step that raised and is re-run draws the same noise.
"""

from __future__ import annotations

import copy
import random
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from voice_server.scheduling.contract import SamplingParams


def apply_repetition_penalty(
    logits: torch.Tensor, histories: Sequence[Sequence[int]], penalties: Sequence[float]
) -> torch.Tensor:
    """In place on logits [S, V]: HF `RepetitionPenaltyLogitsProcessor` per row (divide positive,
    multiply negative scores of every id seen). Rows with penalty 1 or no history are untouched."""
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
    score = sub.gather(1, ids)
    score = torch.where(score < 0, score * penalty, score / penalty)
    logits.index_copy_(0, row_index, sub.scatter(1, ids, score))
    return logits


def top_k_top_p_mask(logits: torch.Tensor, top_ks: Sequence[int], top_ps: Sequence[float]) -> torch.Tensor:
    """In place on logits [S, V] (already divided by temperature): -inf outside each row's top-k
    (0 = off) and outside its smallest set of tokens whose probability reaches top-p (1 = off)."""
    vocab_size = logits.shape[1]
    is_top_p = any(p < 1.0 for p in top_ps)
    if not is_top_p and not any(k > 0 for k in top_ks):
        return logits
    device = logits.device
    ks = torch.tensor([k if 0 < k < vocab_size else vocab_size for k in top_ks], device=device)
    if is_top_p:
        sorted_logits, sorted_ids = logits.sort(dim=-1, descending=True)
    else:
        sorted_logits, sorted_ids = logits.topk(int(ks.max()), dim=-1)
    ranks = torch.arange(sorted_logits.shape[1], device=device)[None, :]
    # NOTE: HF keeps every token scoring at least the k-th (ties at the boundary survive).
    kth = sorted_logits.gather(1, (ks - 1).clamp(max=sorted_logits.shape[1] - 1)[:, None])
    remove = logits < kth
    if is_top_p:
        sorted_logits = sorted_logits.masked_fill(ranks >= ks[:, None], float("-inf"))
        probs = sorted_logits.softmax(dim=-1)
        # NOTE: top_p 1 is off, not "keep mass 1": a float cumsum may reach 1 before the last token.
        ps = torch.tensor([p if p < 1.0 else 2.0 for p in top_ps], dtype=probs.dtype, device=device)[:, None]
        # A token goes when the tokens ranked above it already reach top_p (the first always stays).
        sorted_remove = (probs.cumsum(dim=-1) - probs) >= ps
        sorted_remove[:, 0] = False
        remove |= torch.zeros_like(remove).scatter(1, sorted_ids, sorted_remove)
    return logits.masked_fill_(remove, float("-inf"))


@dataclass(frozen=True)
class Draw:
    """One step's sampled ids, and the state they leave, for `Sampler.commit` once the step succeeded."""

    token_ids: torch.Tensor
    """[S] long, on the logits' device (the caller does `.tolist()`)."""
    generators: tuple[tuple[str, torch.Generator], ...] = ()
    """Request id -> its generator advanced past this step's draw (copies: the held ones are untouched)."""
    seeds: random.Random | None = None
    """The seed stream after seeding this step's new unseeded requests (None: none was new)."""


class Sampler:
    """Picks one token per row of a logits batch; keeps each request's generator until `release`."""

    def __init__(self, seed: int | None = None) -> None:
        self.generators: dict[str, torch.Generator] = {}
        # NOTE: unseeded requests still get their own generator, seeded from this stream.
        self._seeds = random.Random(seed)

    def generator(self, request_id: str, seed: int | None, device: torch.device) -> torch.Generator:
        gen = self.generators.get(request_id)
        if gen is None:
            gen = torch.Generator(device=device)
            gen.manual_seed(seed if seed is not None else self._seeds.getrandbits(63))
            self.generators[request_id] = gen
        return gen

    def release(self, request_id: str) -> None:
        self.generators.pop(request_id, None)

    def sample(
        self,
        logits: torch.Tensor,
        request_ids: Sequence[str],
        params: Sequence[SamplingParams],
        histories: Sequence[Sequence[int]],
    ) -> torch.Tensor:
        """logits [S, V] -> token ids [S] (long, on the logits' device), committed at once."""
        draw = self.draw(logits, request_ids, params, histories)
        self.commit(draw)
        return draw.token_ids

    def commit(self, draw: Draw) -> None:
        """Keep a step's draws: its requests' generators and the seed stream move past them."""
        self.generators.update(draw.generators)
        if draw.seeds is not None:
            self._seeds = draw.seeds

    def draw(
        self,
        logits: torch.Tensor,
        request_ids: Sequence[str],
        params: Sequence[SamplingParams],
        histories: Sequence[Sequence[int]],
    ) -> Draw:
        """logits [S, V] -> token ids [S], leaving every held generator and the seed stream as they were."""
        logits = logits.float()
        apply_repetition_penalty(logits, histories, [p.repetition_penalty for p in params])
        greedy = logits.argmax(dim=-1)
        rows = [i for i, p in enumerate(params) if not p.is_greedy]
        if not rows:
            return Draw(greedy)
        device = logits.device
        row_index = torch.tensor(rows, dtype=torch.long, device=device)
        temps = torch.tensor([params[i].temperature for i in rows], dtype=logits.dtype, device=device)
        scores = logits.index_select(0, row_index) / temps[:, None]
        top_k_top_p_mask(scores, [params[i].top_k for i in rows], [params[i].top_p for i in rows])
        probs = scores.softmax(dim=-1)
        # NOTE: exponential race (argmax of p / E, E ~ Exp(1)) = a draw from p; one noise row per
        # request from its own generator, then a single vectorised argmax.
        noise = torch.empty_like(probs)
        generators: list[tuple[str, torch.Generator]] = []
        seeds: random.Random | None = None
        for j, i in enumerate(rows):
            # NOTE: each row draws from a copy of its request's generator (a new one seeds from a copy
            # of the seed stream): the held state moves only at `commit`.
            gen = torch.Generator(device=device)
            held, seed = self.generators.get(request_ids[i]), params[i].seed
            if held is not None:
                gen.set_state(held.get_state())
            elif seed is not None:
                gen.manual_seed(seed)
            else:
                seeds = seeds or copy.copy(self._seeds)
                gen.manual_seed(seeds.getrandbits(63))
            noise[j].exponential_(generator=gen)
            generators.append((request_ids[i], gen))
        sampled = (probs / noise.clamp_min_(torch.finfo(probs.dtype).tiny)).argmax(dim=-1)
        return Draw(greedy.index_copy_(0, row_index, sampled), tuple(generators), seeds)
