"""Top-k routed mixture of experts (Thinker and Talker), with the Talker's gated shared expert.

Parameter names and layouts match the transformers in-memory model (fused experts:
`experts.gate_up_proj` [E, 2I, H], `experts.down_proj` [E, H, I]); the checkpoint loader fuses
the per-expert tensors of the released layout into these at load time.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from voice_server.models.layers import SwiGLU


class TopKRouter(nn.Module):
    def __init__(self, hidden_size: int, num_experts: int, top_k: int, is_norm_topk_prob: bool) -> None:
        super().__init__()
        self.top_k, self.is_norm_topk_prob = top_k, is_norm_topk_prob
        self.weight = nn.Parameter(torch.zeros(num_experts, hidden_size))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, H] -> (weights [T, k] in x.dtype, expert ids [T, k])."""
        logits = F.linear(x, self.weight)
        # NOTE: softmax in fp32 before top-k, renormalise, then cast: the reference's order.
        probs = F.softmax(logits, dtype=torch.float, dim=-1)
        top_p, top_idx = torch.topk(probs, self.top_k, dim=-1)
        if self.is_norm_topk_prob:
            top_p = top_p / top_p.sum(dim=-1, keepdim=True)
        return top_p.to(logits.dtype), top_idx


class Experts(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int, num_experts: int) -> None:
        super().__init__()
        self.num_experts = num_experts
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * intermediate_size, hidden_size))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden_size, intermediate_size))
        # NOTE: each (token, expert) pair of the gathered path copies one expert's weights, so the
        # transient copy stays within one layer's routed experts; that covers decode steps of up to
        # num_experts / top_k sequences (16 for the released thinker). Not yet measured on a GPU.
        self.max_gathered_pairs = num_experts
        self.is_gathered_on_cpu = False
        """Take the gathered path on the CPU too (a compiled step: the loop's host sync breaks the graph)."""

    def forward(self, x: torch.Tensor, top_idx: torch.Tensor, top_w: torch.Tensor) -> torch.Tensor:
        """x [T, H], top_idx / top_w [T, k] -> sum over k of top_w * expert(x) [T, H].

        NOTE: off the CPU, small T takes the sync-free gathered path. On the CPU the loop's host sync
        costs nothing and the gathered path is 13-28x slower (weight copies and batched GEMV; see
        docs/BENCHMARKS.md, "MoE experts"), so the CPU always loops.
        """
        if (x.device.type != "cpu" or self.is_gathered_on_cpu) and top_idx.numel() <= self.max_gathered_pairs:
            return self.forward_gathered(x, top_idx, top_w)
        return self.forward_looped(x, top_idx, top_w)

    def forward_looped(self, x: torch.Tensor, top_idx: torch.Tensor, top_w: torch.Tensor) -> torch.Tensor:
        """Prefill-sized T: one matmul per expert some token picked, over the tokens that picked it.
        NOTE: `unique().tolist()` is a host sync (on CUDA it stalls the stream, no CUDA graphs)."""
        out = torch.zeros_like(x)
        for expert in top_idx.unique().tolist():
            token_idx, k_pos = torch.where(top_idx == expert)
            gate, up = F.linear(x[token_idx], self.gate_up_proj[expert]).chunk(2, dim=-1)
            y = F.linear(F.silu(gate) * up, self.down_proj[expert]) * top_w[token_idx, k_pos, None]
            out.index_add_(0, token_idx, y.to(out.dtype))
        return out

    def forward_gathered(self, x: torch.Tensor, top_idx: torch.Tensor, top_w: torch.Tensor) -> torch.Tensor:
        """Decode-sized T without a host sync: each (token, expert) pair gathers its expert's weights
        and all pairs run as batched matrix-vector products (gpt-fast's Mixtral decode).

        NOTE: each pair is its own batch entry, so a token's output does not depend on the other tokens
        (the loop's per-expert matmul over a varying number of tokens can change the rounding).
        """
        num_tokens, top_k = top_idx.shape
        flat_idx = top_idx.reshape(-1)
        rows = x.repeat_interleave(top_k, dim=0)[:, :, None]  # [T * k, H, 1]
        gate, up = torch.bmm(self.gate_up_proj[flat_idx], rows).squeeze(-1).chunk(2, dim=-1)
        y = torch.bmm(self.down_proj[flat_idx], (F.silu(gate) * up)[:, :, None]).squeeze(-1)
        y = y.view(num_tokens, top_k, -1) * top_w[..., None]
        return y.sum(dim=1).to(x.dtype)


class SparseMoeBlock(nn.Module):
    """Routed experts, plus `sigmoid(shared_expert_gate(x)) * shared_expert(x)` when
    `shared_intermediate_size` is set (Talker)."""

    def __init__(
        self,
        hidden_size: int,
        moe_intermediate_size: int,
        num_experts: int,
        top_k: int,
        is_norm_topk_prob: bool,
        shared_intermediate_size: int | None = None,
    ) -> None:
        super().__init__()
        self.gate = TopKRouter(hidden_size, num_experts, top_k, is_norm_topk_prob)
        self.experts = Experts(hidden_size, moe_intermediate_size, num_experts)
        self.shared_expert: SwiGLU | None = None
        self.shared_expert_gate: nn.Linear | None = None
        if shared_intermediate_size is not None:
            self.shared_expert = SwiGLU(hidden_size, shared_intermediate_size)
            self.shared_expert_gate = nn.Linear(hidden_size, 1, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        flat = x.reshape(-1, shape[-1])
        top_w, top_idx = self.gate(flat)
        out = self.experts(flat, top_idx, top_w)
        if self.shared_expert is not None and self.shared_expert_gate is not None:
            out = out + torch.sigmoid(self.shared_expert_gate(flat)) * self.shared_expert(flat)
        return out.reshape(shape)
