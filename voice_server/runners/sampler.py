"""Token sampling for a batch of sequences, vectorised over the batch: each request's own settings and
generator, over the processors of `voice_server/models/sampling.py`.

Order and semantics follow transformers: repetition penalty (over prompt and output ids), then for
sampling rows temperature, top-k, top-p. Greedy rows take the argmax of the penalised logits.
Each request draws from its own `torch.Generator` (seeded from `SamplingParams.seed`), so a seeded
request gives the same tokens whatever else is in the batch. `draw` advances no state: a step keeps
its draws with `commit` once it succeeded, so a step that raised and is re-run draws the same noise.
`fork` gives the same copies to a step that draws its own noise (the talker's pre-drawn frame noise).
"""

from __future__ import annotations

import copy
import random
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from voice_server.models.sampling import penalize_histories, per_row, race, top_k_top_p_mask
from voice_server.scheduling.contract import SamplingParams


@dataclass(frozen=True)
class Forks:
    """Copies of some requests' generators for one step to draw from (`Sampler.fork`); `Sampler.commit`
    keeps them, advanced by the step's draws, once the step succeeded."""

    generators: tuple[tuple[str, torch.Generator], ...] = ()
    """Request id -> a copy of its generator (a new request's is seeded as `Sampler` would seed it)."""
    seeds: random.Random | None = None
    """The seed stream after seeding this step's new unseeded requests (None: none was new)."""


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

    def fork(self, request_ids: Sequence[str], seeds: Sequence[int | None], device: torch.device) -> Forks:
        """A copy of each request's generator (a new one seeded from `seeds[i]`, else from a copy of the
        seed stream), for a step that draws its own noise; nothing held moves until `commit`."""
        generators: list[tuple[str, torch.Generator]] = []
        stream: random.Random | None = None
        for request_id, seed in zip(request_ids, seeds, strict=True):
            gen = torch.Generator(device=device)
            held = self.generators.get(request_id)
            if held is not None:
                gen.set_state(held.get_state())
            elif seed is not None:
                gen.manual_seed(seed)
            else:
                stream = stream or copy.copy(self._seeds)
                gen.manual_seed(stream.getrandbits(63))
            generators.append((request_id, gen))
        return Forks(tuple(generators), stream)

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

    def commit(self, draw: Draw | Forks) -> None:
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
        penalize_histories(logits, histories, [p.repetition_penalty for p in params])
        greedy = logits.argmax(dim=-1)
        rows = [i for i, p in enumerate(params) if not p.is_greedy]
        if not rows:
            return Draw(greedy)
        device = logits.device
        row_index = torch.tensor(rows, dtype=torch.long, device=device)
        scores = logits.index_select(0, row_index) / per_row([params[i].temperature for i in rows], logits)
        probs = top_k_top_p_mask(scores, [params[i].top_k for i in rows], [params[i].top_p for i in rows]).softmax(-1)
        # NOTE: the exponential race (`race`) with one noise row per request from a copy of its generator
        # (`fork`: the held state moves only at `commit`), then a single vectorised argmax.
        forks = self.fork([request_ids[i] for i in rows], [params[i].seed for i in rows], device)
        noise = torch.empty_like(probs)
        for j, (_, gen) in enumerate(forks.generators):
            noise[j].exponential_(generator=gen)
        sampled = race(probs, noise)
        return Draw(greedy.index_copy_(0, row_index, sampled), forks.generators, forks.seeds)
