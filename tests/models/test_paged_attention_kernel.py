"""`paged_decode_attention` (voice_server/kernels): decode rows straight from the KV pages, against
gather + SDPA, inside `AttentionContext` (mixed prefill/decode steps, padding), batch and thread
invariance."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from voice_server import kernels
from voice_server.models.paged import PagedKVCache, build_attention_context

torch.set_num_threads(1)

NUM_PAGES, PAGE_SIZE, KV_HEADS, HEADS, HEAD_DIM = 48, 16, 3, 9, 64


@pytest.fixture(scope="module", autouse=True)
def _built() -> None:
    assert kernels.available(), "the C++ kernels did not build (see the logged warning)"


def _pages(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    shape = (NUM_PAGES + 1, PAGE_SIZE, KV_HEADS, HEAD_DIM)
    return torch.randn(shape, generator=gen), torch.randn(shape, generator=gen)


def _sdpa(q: torch.Tensor, k_pages: torch.Tensor, v_pages: torch.Tensor, pages: list[int], kv_len: int) -> torch.Tensor:
    """q [H, D] of one sequence over its pages -> [H, D] (gather + SDPA, the path it replaces)."""
    k = k_pages[pages].reshape(-1, KV_HEADS, HEAD_DIM)[:kv_len].transpose(0, 1)[None]
    v = v_pages[pages].reshape(-1, KV_HEADS, HEAD_DIM)[:kv_len].transpose(0, 1)[None]
    return F.scaled_dot_product_attention(q[None, :, None], k, v, enable_gqa=True)[0, :, 0]


def _run(q: torch.Tensor, k_pages: torch.Tensor, v_pages: torch.Tensor, seq_pages: list[list[int]],
         kv_lens: list[int], impl: str = "auto") -> torch.Tensor:
    page_index = torch.tensor([p for pages in seq_pages for p in pages])
    starts = [sum(len(p) for p in seq_pages[:i]) for i in range(len(seq_pages))]
    seqs = torch.tensor([[i, starts[i], n] for i, n in enumerate(kv_lens)])
    out = torch.zeros(q.shape)
    torch.ops.voice_server.paged_decode_attention(
        q, k_pages, v_pages, page_index, seqs, HEAD_DIM**-0.5, out, kernels.IMPLS[impl]
    )
    return out


def _impls() -> list[str]:
    """Every path this CPU runs (scalar, avx2, avx512: the kernels refuse one it lacks), then auto."""
    best = kernels.best_impl()
    return [name for name, value in kernels.IMPLS.items() if 0 < value <= best] + ["auto"]


def _seq_pages(kv_lens: list[int], seed: int = 1) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    order = torch.randperm(NUM_PAGES, generator=gen).tolist()
    out, at = [], 0
    for n in kv_lens:
        count = -(-n // PAGE_SIZE)
        out.append(order[at : at + count])
        at += count
    return out


def test_matches_gather_and_sdpa() -> None:
    k_pages, v_pages = _pages()
    kv_lens = [1, 16, 17, 100, 250]
    seq_pages = _seq_pages(kv_lens)
    # NOTE: q strided like the runner's (a head slice of the fused q/k rotation output).
    q = torch.randn(1, HEADS + KV_HEADS, len(kv_lens) + 2, HEAD_DIM)[0, :HEADS].transpose(0, 1)
    for impl in _impls():
        out = _run(q, k_pages, v_pages, seq_pages, kv_lens, impl)
        for i, n in enumerate(kv_lens):
            assert (out[i] - _sdpa(q[i], k_pages, v_pages, seq_pages[i], n)).abs().max() <= 2e-5, impl
        assert out[len(kv_lens) :].eq(0).all()  # rows not named in seqs are left alone


def test_fp16_pages_read_as_their_fp32_values() -> None:
    k_pages, v_pages = _pages(5)
    k_half, v_half = k_pages.half(), v_pages.half()
    kv_lens = [3, 40, 129]
    seq_pages = _seq_pages(kv_lens, seed=6)
    q = torch.randn(len(kv_lens), HEADS, HEAD_DIM)
    for impl in _impls():
        half = _run(q, k_half, v_half, seq_pages, kv_lens, impl)
        widened = _run(q, k_half.float(), v_half.float(), seq_pages, kv_lens, impl)
        assert (half - widened).abs().max() <= 1e-5, impl


def test_a_sequence_alone_and_in_a_crowd() -> None:
    k_pages, v_pages = _pages(2)
    kv_lens = [40, 7, 130, 64]
    seq_pages = _seq_pages(kv_lens, seed=3)
    q = torch.randn(len(kv_lens), HEADS, HEAD_DIM)
    crowd = _run(q, k_pages, v_pages, seq_pages, kv_lens)
    for i in range(len(kv_lens)):
        alone = _run(q[i : i + 1], k_pages, v_pages, seq_pages[i : i + 1], kv_lens[i : i + 1])
        assert torch.equal(alone[0], crowd[i])
    try:
        torch.set_num_threads(2)
        assert torch.equal(_run(q, k_pages, v_pages, seq_pages, kv_lens), crowd)
    finally:
        torch.set_num_threads(1)


def test_bad_arguments_rejected() -> None:
    k_pages, v_pages = _pages()
    q = torch.randn(2, HEADS, HEAD_DIM)
    with pytest.raises(RuntimeError, match="out of range"):
        _run(q, k_pages, v_pages, [[0]], [PAGE_SIZE + 1])
    with pytest.raises(RuntimeError, match="head"):
        _run(torch.randn(2, 8, HEAD_DIM), k_pages, v_pages, [[0]], [3])


def test_attention_context_with_and_without_the_kernel() -> None:
    """A mixed step (two decode rows, one prefill chunk, padding) through both paths of `attend`."""
    caches = [PagedKVCache(1, NUM_PAGES, PAGE_SIZE, KV_HEADS, HEAD_DIM, torch.float32, use_decode_kernel=flag)
              for flag in (True, False)]
    k_pages, v_pages = _pages(4)
    for cache in caches:
        cache.kv[0, 0].copy_(k_pages)
        cache.kv[0, 1].copy_(v_pages)
    seqs = [(30, 1, [0, 1]), (10, 5, [2]), (50, 1, [3, 4, 5, 6])]
    num_rows = 9
    gen = torch.Generator().manual_seed(5)
    q = torch.randn(1, HEADS, num_rows, HEAD_DIM, generator=gen)
    k = torch.randn(1, KV_HEADS, num_rows, HEAD_DIM, generator=gen)
    v = torch.randn(1, KV_HEADS, num_rows, HEAD_DIM, generator=gen)
    outs = []
    for cache in caches:
        ctx, _ = build_attention_context(cache, seqs, num_rows)
        assert (ctx.decode_seqs is not None) == cache.use_decode_kernel
        outs.append(ctx.attend(0, q, k, v, None))
    with_kernel, without = outs
    assert with_kernel.shape == without.shape == (1, HEADS, num_rows, HEAD_DIM)
    assert (with_kernel - without).abs().max() <= 2e-5
    assert with_kernel[:, :, 7:].eq(0).all()  # padding rows
