"""The MoE experts' two paths agree: the sync-free gathered path (decode-sized T off the CPU) and the
per-expert loop (prefill-sized T, and always on the CPU). fp32; tolerance atol = rtol = 1e-5 (the paths
sum the k experts in different orders and use different matmul kernels, so they are not bit-identical)."""

from __future__ import annotations

import pytest
import torch

from voice_server.models.qwen3_omni.moe import SparseMoeBlock

torch.set_num_threads(1)
TOL = 1e-5


def _block(hidden: int, inter: int, num_experts: int, top_k: int, shared: int | None) -> SparseMoeBlock:
    g = torch.Generator().manual_seed(0)
    block = SparseMoeBlock(hidden, inter, num_experts, top_k, True, shared_intermediate_size=shared)
    with torch.no_grad():
        for p in block.parameters():
            p.copy_(0.2 * torch.randn(p.shape, generator=g))
    return block


@pytest.mark.parametrize("num_tokens", [1, 3, 8, 40])
@pytest.mark.parametrize(("num_experts", "top_k", "shared"), [(4, 2, None), (16, 6, 24)])
@torch.no_grad()
def test_gathered_experts_equal_the_loop(num_tokens: int, num_experts: int, top_k: int, shared: int | None) -> None:
    block = _block(32, 16, num_experts, top_k, shared)
    x = torch.randn(num_tokens, 32, generator=torch.Generator().manual_seed(num_tokens))
    top_w, top_idx = block.gate(x)
    looped = block.experts.forward_looped(x, top_idx, top_w)
    gathered = block.experts.forward_gathered(x, top_idx, top_w)
    torch.testing.assert_close(gathered, looped, atol=TOL, rtol=TOL)
    assert looped.abs().max() > 0.1  # the experts did something


@torch.no_grad()
def test_gathered_rows_do_not_depend_on_the_other_tokens() -> None:
    block = _block(32, 16, 8, 2, None)
    x = torch.randn(6, 32, generator=torch.Generator().manual_seed(1))
    top_w, top_idx = block.gate(x)
    batch = block.experts.forward_gathered(x, top_idx, top_w)
    for i in range(6):
        alone = block.experts.forward_gathered(x[i : i + 1], top_idx[i : i + 1], top_w[i : i + 1])
        assert torch.equal(alone[0], batch[i])


@torch.no_grad()
def test_cpu_always_loops() -> None:
    # NOTE: on the CPU the loop's host sync is free and the gathered path is many times slower.
    block = _block(32, 16, 4, 2, None)
    x = torch.randn(1, 32)
    top_w, top_idx = block.gate(x)
    assert top_idx.numel() <= block.experts.max_gathered_pairs
    assert torch.equal(block.experts(x, top_idx, top_w), block.experts.forward_looped(x, top_idx, top_w))
