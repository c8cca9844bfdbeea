"""Ragged paged steps for model-level tests: which rows of which sequences each step runs.

A tiny stand-in for the AR scheduler: sequences join at given steps, prefill in chunks of at most
`chunk_len` rows, then decode one row per step; every sequence gets its own shuffled pages.
"""

from __future__ import annotations

import random
from dataclasses import dataclass


@dataclass(frozen=True)
class Chunk:
    seq: int
    start: int  # first position of the rows
    num_rows: int
    is_sampling: bool  # the chunk ends the prompt or is a decode row: its last row is sampled


def shuffled_pages(num_seqs: int, pages_per_seq: int, seed: int = 0) -> list[list[int]]:
    """Disjoint page tables, interleaved across sequences so no sequence reads contiguous pages."""
    pages = list(range(num_seqs * pages_per_seq))
    random.Random(seed).shuffle(pages)
    return [pages[i::num_seqs] for i in range(num_seqs)]


def plan_step(
    prompt_lens: list[int], fed: list[int], is_active: list[bool], chunk_len: int
) -> list[Chunk]:
    """The chunks of one step for the active sequences, given how many positions each has fed."""
    chunks = []
    for i, (prompt_len, num_fed) in enumerate(zip(prompt_lens, fed, strict=True)):
        if not is_active[i]:
            continue
        if num_fed < prompt_len:
            num_rows = min(chunk_len, prompt_len - num_fed)
            chunks.append(Chunk(i, num_fed, num_rows, num_fed + num_rows == prompt_len))
        else:
            chunks.append(Chunk(i, num_fed, 1, True))
    return chunks


def last_rows(chunks: list[Chunk]) -> list[int]:
    """Flat row index of the last row of every sampling chunk, in chunk order."""
    rows, end = [], 0
    for chunk in chunks:
        end += chunk.num_rows
        if chunk.is_sampling:
            rows.append(end - 1)
    return rows
