"""Paged KV cache and per-step attention context for a ragged batch (flat tokens of many sequences).

The runner owns one `PagedKVCache` and builds one `AttentionContext` per step; every layer's
`Attention.forward` takes the context in place of the contiguous `KVCache`, writes the step's
keys/values by slot mapping and attends each sequence over its own pages.

NOTE: batch invariance (a sequence gets bit-identical logits alone and in any batch) shapes the
attention here: SDPA over a key axis padded with masked keys differs from the unpadded call by an
ulp (measured, torch 2.13 CPU), so each sequence gets its own SDPA call over exactly its `kv_len`
keys rather than one padded call for all decode sequences. Measured cost on SmolLM2 (3 KV heads,
head_dim 64): ~40 us per call, so ~10 ms per step for 8 sequences x 30 layers. Where our C++ kernels
run (`voice_server/kernels`, AVX2 or AVX512, fp32 or fp16 cache), decode rows instead go through one
`paged_decode_attention` call per layer that reads keys and values straight from the pages (no
gather) and computes each sequence on its own: batch invariant too, equal to SDPA within fp32
rounding; prefill spans keep SDPA. A w4a8 Llama-family model there skips `attend` altogether: its
fused C++ layers (`voice_server.models.llama.fused`) write the cache and attend every row themselves,
and may keep the cache in fp16, which `attend` refuses.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import Protocol

import torch
import torch.nn.functional as F

from voice_server import kernels
from voice_server.models.layers import causal_mask


def decode_kernel_usable(dtype: torch.dtype, device: torch.device | str) -> bool:
    """Whether `paged_decode_attention` serves this cache: fp32 (or fp16, which only the fused layers
    write) on a CPU whose kernels run AVX2 or AVX512 (its scalar path is only the reference, slower than
    SDPA)."""
    return (
        dtype in (torch.float32, torch.float16) and torch.device(device).type == "cpu" and kernels.available()
        and kernels.best_impl() >= kernels.IMPLS["avx2"]
    )


class PagedAttention(Protocol):
    """What a layer's `Attention` calls in place of a contiguous cache: write this step's keys and
    values, attend. `AttentionContext` (exact, per sequence) and `paged_static.StaticDecodeContext`
    (fixed shapes, for CUDA graphs) implement it."""

    def attend(
        self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sliding_window: int | None
    ) -> torch.Tensor: ...


class PagedKVCache:
    """Keys and values of every layer in pages: `[num_layers, 2, num_pages + 1, page_size, H_kv, D]`.

    Page `num_pages` is a scratch page the scheduler never hands out: padding rows of a step write
    their keys/values there (`scratch_slot`).
    """

    def __init__(
        self,
        num_layers: int,
        num_pages: int,
        page_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str = "cpu",
        use_decode_kernel: bool | None = None,
    ) -> None:
        """`use_decode_kernel`: decode rows through `paged_decode_attention` (None: where usable)."""
        for name, value in (("num_layers", num_layers), ("num_pages", num_pages), ("page_size", page_size)):
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"PagedKVCache.{name} must be an integer >= 1, got {value!r}")
        self.num_layers, self.num_pages, self.page_size = num_layers, num_pages, page_size
        self.num_kv_heads, self.head_dim = num_kv_heads, head_dim
        # NOTE: zeros, not empty: the kernel maps zero pages lazily, and a slot read before it is
        # written (a bug) then gives finite garbage rather than NaN.
        self.kv = torch.zeros(
            num_layers, 2, num_pages + 1, page_size, num_kv_heads, head_dim, dtype=dtype, device=device
        )
        # NOTE: views made once: indexing `kv` per layer per step cost ~30 us each (profiled).
        # `pages[i]`: layer i's keys and values [num_pages + 1, page_size, H_kv, D]; `slots[i]`: the
        # same flattened to [(num_pages + 1) * page_size, H_kv, D] for writes by slot.
        self.pages = [(self.kv[i, 0], self.kv[i, 1]) for i in range(num_layers)]
        self.slots = [(k.view(-1, num_kv_heads, head_dim), v.view(-1, num_kv_heads, head_dim)) for k, v in self.pages]
        self._padding: dict[tuple[int, int], torch.Tensor] = {}
        self.use_decode_kernel = decode_kernel_usable(dtype, device) if use_decode_kernel is None else use_decode_kernel

    def padding_output(self, num_heads: int, num_padding: int) -> torch.Tensor:
        """Zeros `[1, num_heads, num_padding, D]`: the padding rows' attention output (made once,
        shared by every layer and step: `attend` only reads it)."""
        out = self._padding.get((num_heads, num_padding))
        if out is None:
            out = self._padding[num_heads, num_padding] = torch.zeros(
                1, num_heads, num_padding, self.head_dim, dtype=self.kv.dtype, device=self.kv.device
            )
        return out

    def write(
        self, layer_idx: int, slot_mapping: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sliding_window: int | None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Store a step's keys/values k, v [1, H_kv, num_rows, D] at `slot_mapping` [num_rows]; return
        the layer's key and value pages [num_pages + 1, page_size, H_kv, D] to read from."""
        if sliding_window is not None:
            raise NotImplementedError("paged attention does not support sliding-window layers")
        k_slots, v_slots = self.slots[layer_idx]
        k_slots.index_copy_(0, slot_mapping, k[0].transpose(0, 1))
        v_slots.index_copy_(0, slot_mapping, v[0].transpose(0, 1))
        return self.pages[layer_idx]

    @staticmethod
    def bytes_per_page(
        num_layers: int, page_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype
    ) -> int:
        elem = torch.empty((), dtype=dtype).element_size()
        return num_layers * 2 * page_size * num_kv_heads * head_dim * elem

    @property
    def scratch_slot(self) -> int:
        """The first slot of the scratch page (every slot before it belongs to a real page)."""
        return self.num_pages * self.page_size


@dataclass(frozen=True)
class SeqSpan:
    """One sequence's part of a step: query rows `[query_start, query_start + query_len)` of the flat
    batch at positions `kv_len - query_len ... kv_len - 1`, keys from `page_start` pages into
    `AttentionContext.page_index`."""

    query_start: int
    query_len: int
    kv_len: int
    page_start: int


@dataclass(frozen=True)
class AttentionContext:
    """What every layer needs to attend a ragged batch over the paged cache; built once per step."""

    cache: PagedKVCache
    slot_mapping: torch.Tensor
    """[num_rows] long: flat slot (`page * page_size + pos % page_size`) each row's k/v goes to."""
    page_index: torch.Tensor
    """[sum of pages read] long: the pages of every sequence, concatenated in `spans` order."""
    spans: tuple[SeqSpan, ...]
    masks: tuple[torch.Tensor | None, ...]
    """Per span: bool [query_len, kv_len] causal mask offset by the start position (None for one
    query row, which sees every key)."""
    num_rows: int
    """Rows of the step's activations, padding included (padding rows come last)."""
    decode_seqs: torch.Tensor | None = None
    """[num decode spans, 3] long (row, page_start, kv_len) when the cache's decode kernel serves
    the spans of one query row (None: every span through SDPA)."""

    @cached_property
    def row_seqs(self) -> torch.Tensor:
        """[rows that attend, 3] long (row, page_start, kv_len): each real row over its own causal prefix
        (a prefill row at position p reads p + 1 keys), for kernels that attend row by row."""
        rows = [
            (span.query_start + i, span.page_start, span.kv_len - span.query_len + 1 + i)
            for span in self.spans for i in range(span.query_len)
        ]
        return torch.tensor(rows, dtype=torch.long, device=self.slot_mapping.device).reshape(-1, 3)

    def attend(
        self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sliding_window: int | None
    ) -> torch.Tensor:
        """q [1, H, num_rows, D], k/v [1, H_kv, num_rows, D] (rotated) -> attention output like q."""
        cache = self.cache
        if cache.kv.dtype != q.dtype:
            raise ValueError(
                f"a {cache.kv.dtype} KV cache with {q.dtype} activations: only the fused C++ layers "
                "(voice_server.models.llama.fused) write and read an fp16 cache"
            )
        k_pages, v_pages = cache.write(layer_idx, self.slot_mapping, k, v, sliding_window)
        if self.decode_seqs is not None:
            return self._attend_with_kernel(q, k_pages, v_pages)
        ps, heads_kv, head_dim = cache.page_size, cache.num_kv_heads, cache.head_dim
        # NOTE: one gather of whole pages per layer for all sequences; each sequence then reads a
        # view of it, trimmed to its own kv_len.
        k_read = k_pages.index_select(0, self.page_index)
        v_read = v_pages.index_select(0, self.page_index)
        outs = []
        # NOTE: each sequence's keys as one as_strided view of the gather ([1, H_kv, kv_len, D],
        # the layout slice + transpose + unsqueeze gave, so the same bits): 1 op instead of 3.
        stride = (heads_kv * head_dim, head_dim, heads_kv * head_dim, 1)
        for span, mask in zip(self.spans, self.masks, strict=True):
            size = (1, heads_kv, span.kv_len, head_dim)
            offset = span.page_start * ps * heads_kv * head_dim
            ks = k_read.as_strided(size, stride, offset)
            vs = v_read.as_strided(size, stride, offset)
            qs = q[:, :, span.query_start : span.query_start + span.query_len]
            outs.append(F.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask, enable_gqa=True))
        num_padding = self.num_rows - sum(s.query_len for s in self.spans)
        if num_padding:
            outs.append(cache.padding_output(q.shape[1], num_padding))
        return outs[0] if len(outs) == 1 else torch.cat(outs, dim=2)

    def _attend_with_kernel(self, q: torch.Tensor, k_pages: torch.Tensor, v_pages: torch.Tensor) -> torch.Tensor:
        """Decode rows by `paged_decode_attention` from the pages; prefill spans by SDPA over their own
        gathered pages; padding rows zero. Returns [1, H, num_rows, D] (a view of [num_rows, H, D])."""
        assert self.decode_seqs is not None
        heads, head_dim = q.shape[1], q.shape[3]
        prefill = [(span, mask) for span, mask in zip(self.spans, self.masks, strict=True) if span.query_len > 1]
        is_full = not prefill and len(self.spans) == self.num_rows
        out = (torch.empty if is_full else torch.zeros)(self.num_rows, heads, head_dim, dtype=q.dtype, device=q.device)
        torch.ops.voice_server.paged_decode_attention(
            q[0].transpose(0, 1), k_pages, v_pages, self.page_index, self.decode_seqs, head_dim**-0.5, out
        )
        ps, heads_kv = self.cache.page_size, self.cache.num_kv_heads
        for span, mask in prefill:
            pages = self.page_index[span.page_start : span.page_start + -(-span.kv_len // ps)]
            ks = k_pages.index_select(0, pages).view(-1, heads_kv, head_dim)[: span.kv_len].transpose(0, 1)
            vs = v_pages.index_select(0, pages).view(-1, heads_kv, head_dim)[: span.kv_len].transpose(0, 1)
            qs = q[:, :, span.query_start : span.query_start + span.query_len]
            att = F.scaled_dot_product_attention(qs, ks[None], vs[None], attn_mask=mask, enable_gqa=True)
            out[span.query_start : span.query_start + span.query_len] = att[0].transpose(0, 1)
        return out.transpose(0, 1).unsqueeze(0)


def build_attention_context(
    cache: PagedKVCache,
    seqs: Sequence[tuple[int, int, Sequence[int]]],
    num_rows: int,
    device: torch.device | str = "cpu",
) -> tuple[AttentionContext, torch.Tensor]:
    """Context and positions [num_rows] for sequences given as (start_pos, query_len, page_ids).

    Rows beyond the sequences' tokens are padding: position 0, written to the scratch slot.
    """
    ps = cache.page_size
    slots: list[int] = []
    positions: list[int] = []
    pages: list[int] = []
    spans: list[SeqSpan] = []
    masks: list[torch.Tensor | None] = []
    row = 0
    for start, query_len, page_ids in seqs:
        kv_len = start + query_len
        num_pages = -(-kv_len // ps)
        if num_pages > len(page_ids):
            raise ValueError(f"page table of {len(page_ids)} pages does not cover {kv_len} positions")
        positions.extend(range(start, kv_len))
        slots.extend(page_ids[p // ps] * ps + p % ps for p in range(start, kv_len))
        spans.append(SeqSpan(row, query_len, kv_len, len(pages)))
        pages.extend(page_ids[:num_pages])
        masks.append(None if query_len == 1 else causal_mask(query_len, kv_len, torch.device(device)))
        row += query_len
    if row > num_rows:
        raise ValueError(f"{row} tokens do not fit {num_rows} rows")
    slots.extend([cache.scratch_slot] * (num_rows - row))
    positions.extend([0] * (num_rows - row))
    decode = [(s.query_start, s.page_start, s.kv_len) for s in spans if s.query_len == 1]
    ctx = AttentionContext(
        cache=cache,
        slot_mapping=torch.tensor(slots, dtype=torch.long, device=device),
        page_index=torch.tensor(pages, dtype=torch.long, device=device),
        spans=tuple(spans),
        masks=tuple(masks),
        num_rows=num_rows,
        decode_seqs=torch.tensor(decode, dtype=torch.long, device=device) if cache.use_decode_kernel and decode
        else None,
    )
    return ctx, torch.tensor(positions, dtype=torch.long, device=device)
