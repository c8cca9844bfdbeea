"""Fixed-shape decode attention over the paged KV cache: what a CUDA graph can capture.

`AttentionContext` (paged.py) is built per step with one SDPA per sequence over exactly its keys:
exact and batch invariant, but its shapes and Python loop change every step. `StaticDecodeContext`
is the other trade: a decode step of up to `num_rows` sequences, one row each, whose page tables are
padded to `max_pages` pages in a preallocated buffer; every layer gathers all of them and runs one
masked SDPA. Every tensor it touches lives in its own buffers, so a captured graph replays the step
after the caller copies the next step's slots, page tables and key counts into them (`fill`).

Costs: each layer reads `num_rows * max_pages * page_size` keys whatever the real lengths (so keep
`max_pages` to what decode graphs should cover, and run longer sequences eagerly), and masked keys
round the softmax differently from the exact-length call by an ulp (fine for serving; the eager
path stays the reference).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F

from voice_server.models.paged import PagedKVCache


class StaticDecodeContext:
    """Duck-types `AttentionContext.attend` for a step of one decode row per sequence."""

    def __init__(self, cache: PagedKVCache, num_rows: int, max_pages: int) -> None:
        if num_rows < 1 or max_pages < 1:
            raise ValueError(f"StaticDecodeContext: num_rows and max_pages must be >= 1, got {num_rows}, {max_pages}")
        self.cache, self.num_rows, self.max_pages = cache, num_rows, max_pages
        device = cache.kv.device
        self.slot_mapping = torch.full((num_rows,), cache.scratch_slot, dtype=torch.long, device=device)
        self.page_table = torch.full((num_rows, max_pages), cache.num_pages, dtype=torch.long, device=device)
        self.kv_lens = torch.ones(num_rows, dtype=torch.long, device=device)
        self._key_index = torch.arange(max_pages * cache.page_size, device=device)

    @property
    def max_len(self) -> int:
        return self.max_pages * self.cache.page_size

    def fill(self, seqs: Sequence[tuple[int, Sequence[int]]]) -> None:
        """Set the step's sequences as (position of the new token, page table); rows past them
        become padding (the scratch page, one key) whose outputs the caller ignores."""
        if len(seqs) > self.num_rows:
            raise ValueError(f"{len(seqs)} sequences do not fit {self.num_rows} rows")
        ps, scratch_page = self.cache.page_size, self.cache.num_pages
        slots, tables, lens = [], [], []
        for pos, page_ids in seqs:
            num_pages = pos // ps + 1
            if num_pages > self.max_pages or num_pages > len(page_ids):
                raise ValueError(f"position {pos} needs {num_pages} pages: over max_pages {self.max_pages} "
                                 f"or the page table's {len(page_ids)}")
            slots.append(page_ids[pos // ps] * ps + pos % ps)
            tables.append(list(page_ids[:num_pages]) + [scratch_page] * (self.max_pages - num_pages))
            lens.append(pos + 1)
        num_padding = self.num_rows - len(seqs)
        slots += [self.cache.scratch_slot] * num_padding
        tables += [[scratch_page] * self.max_pages] * num_padding
        lens += [1] * num_padding
        # NOTE: copies into the captured buffers (never rebinding them): a graph reads these addresses.
        self.slot_mapping.copy_(torch.tensor(slots, dtype=torch.long))
        self.page_table.copy_(torch.tensor(tables, dtype=torch.long))
        self.kv_lens.copy_(torch.tensor(lens, dtype=torch.long))

    def attend(
        self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sliding_window: int | None
    ) -> torch.Tensor:
        """q [1, H, num_rows, D], k/v [1, H_kv, num_rows, D] (rotated) -> attention output like q."""
        cache = self.cache
        k_pages, v_pages = cache.write(layer_idx, self.slot_mapping, k, v, sliding_window)
        shape = (self.num_rows, self.max_len, cache.num_kv_heads, cache.head_dim)
        keys = k_pages.index_select(0, self.page_table.flatten()).view(shape).transpose(1, 2)
        values = v_pages.index_select(0, self.page_table.flatten()).view(shape).transpose(1, 2)
        mask = (self._key_index[None] < self.kv_lens[:, None])[:, None, None]  # [rows, 1, 1, max_len]
        out = F.scaled_dot_product_attention(q[0].transpose(0, 1)[:, :, None], keys, values, attn_mask=mask,
                                             enable_gqa=True)  # [rows, H, 1, D]
        return out[:, :, 0].transpose(0, 1)[None]
