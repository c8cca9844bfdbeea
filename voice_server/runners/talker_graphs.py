"""Talker decode steps on fixed shapes, one set of buffers per batch-size bucket; CUDA graphs on CUDA.

A decode-only talker step (every sequence feeds one row and makes one frame) is the hot loop of
speech output: talker pass, code 0, the code predictor's G-1 small passes, all tiny kernels whose
launch overhead dominates on a GPU. Here each bucket size B (1, 2, 4, 8, 16 by default) owns its
input buffers, a `StaticDecodeContext` (page tables padded to `max_len` positions) and, on CUDA, a
graph of `step_paged` captured once; a step of S <= B sequences copies its rows into the smallest
bucket that fits and replays it. On the CPU the same buffers run eagerly (what the tests check
against the dynamic path; no capture there). Sampled talkers draw inside the graph with noise the
runner pre-draws from each request's generator (`FrameNoise`), the same way its eager path does.

`is_compiled` (CPU): the CPU's stand-in for the graphs, each bucket's step compiled by
`torch.compile` (inductor) at start-up; on the tiny config it makes a batch-1 frame ~3x faster than
the eager step (the step is a couple of thousand tiny ops, so dispatch, not arithmetic, is its cost).

NOTE: the MoE layers must not loop over experts with a host sync inside a graph: the experts'
sync-free gathered path is enabled up to the largest bucket (`Experts.max_gathered_pairs`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from voice_server.models.paged import PagedKVCache
from voice_server.models.paged_static import StaticDecodeContext
from voice_server.models.qwen3_omni.moe import Experts
from voice_server.models.qwen3_omni.talker.model import Talker
from voice_server.models.qwen3_omni.talker.sampling import TalkerSampling
from voice_server.models.qwen3_omni.talker.step import FrameNoise, TalkerPagedStep, step_paged
from voice_server.scheduling.contract import ARSeq

DEFAULT_BUCKETS = (1, 2, 4, 8, 16)


@dataclass
class _Bucket:
    ctx: StaticDecodeContext
    inputs: torch.Tensor  # [B, H]
    positions: torch.Tensor  # [B]
    rows: torch.Tensor  # [B]: every row completes a frame
    text_vec: torch.Tensor  # [B, H] zeros: the runner adds text vectors when it feeds a frame back
    seen: torch.Tensor  # [B, V] code-0 repetition history, updated in place by the step
    noise: FrameNoise | None  # pre-drawn Exp(1) noise of sampled talkers (ones for padding rows)
    graph: torch.cuda.CUDAGraph | None = None
    out: TalkerPagedStep | None = None


class TalkerDecodeGraphs:
    def __init__(
        self, talker: Talker, cache: PagedKVCache, sampling: TalkerSampling, max_len: int,
        buckets: Sequence[int] = DEFAULT_BUCKETS, is_compiled: bool = False,
    ) -> None:
        self.is_sampled = not (sampling.code0.is_greedy and sampling.residual.is_greedy)
        self.talker, self.cache, self.sampling = talker, cache, sampling
        self.max_pages = -(-max_len // cache.page_size)
        self.buckets = tuple(sorted(set(buckets)))
        device = cache.kv.device
        self.is_captured = device.type == "cuda"
        self.is_compiled = is_compiled and not self.is_captured
        if self.is_captured or self.is_compiled:
            top_k = talker.cfg.num_experts_per_tok
            for module in talker.modules():
                if isinstance(module, Experts):
                    module.max_gathered_pairs = max(module.max_gathered_pairs, self.buckets[-1] * top_k)
                    module.is_gathered_on_cpu = self.is_compiled
        cfg, dtype = talker.cfg, cache.kv.dtype
        self._buckets = {
            size: _Bucket(
                ctx=StaticDecodeContext(cache, size, self.max_pages),
                inputs=torch.zeros(size, cfg.hidden_size, dtype=dtype, device=device),
                positions=torch.zeros(size, dtype=torch.long, device=device),
                rows=torch.arange(size, device=device),
                text_vec=torch.zeros(size, cfg.hidden_size, dtype=dtype, device=device),
                seen=torch.zeros(size, cfg.vocab_size, dtype=torch.bool, device=device),
                noise=FrameNoise(
                    torch.ones(size, cfg.vocab_size, device=device),
                    torch.ones(size, cfg.num_code_groups - 1, cfg.code_predictor.vocab_size, device=device),
                ) if self.is_sampled else None,
            )
            for size in self.buckets
        }
        self._step_fn = torch.compile(self._step) if self.is_compiled else self._step
        # NOTE: under inference mode, as the runner's steps run: a graph or compiled code made with
        # autograd state would not match (or not be reused by) the steps that replay it.
        with torch.inference_mode():
            for bucket in self._buckets.values():
                if self.is_captured:
                    self._capture(bucket)
                elif self.is_compiled:
                    self._step_fn(bucket)  # NOTE: compile every bucket now, not inside a request
        self.num_steps = 0
        """Steps run here (the rest ran on the runner's exact, dynamic path)."""

    @property
    def max_len(self) -> int:
        return self.max_pages * self.cache.page_size

    def can_run(self, seqs: Sequence[ARSeq], positions: Sequence[int]) -> bool:
        """Decode-only steps (one row per sequence, each completing a frame) that fit a bucket, at rotary
        `positions` (one per sequence) the rotary table covers.

        NOTE: whole positions only (the int64 buffer and table lookup the graphs captured): the runner steps a
        batch holding a prompt with fractional (float32) positions on its exact path instead."""
        num_positions = self.talker.cfg.max_position_embeddings
        return len(seqs) <= self.buckets[-1] and all(
            len(s.token_ids) == 1 and s.is_sampling and s.start_pos < self.max_len and 0 <= p < num_positions
            for s, p in zip(seqs, positions, strict=True))

    def run(
        self, seqs: Sequence[ARSeq], positions: Sequence[int], inputs: torch.Tensor, seen: torch.Tensor,
        noise: FrameNoise | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """One row per sequence: its rotary position (all three axes: `start_pos` plus the prompt's M-RoPE
        delta), inputs [S, H], seen [S, V] (and the rows' noise when sampled) -> (codes [S, G],
        codebook-embedding sums [S, H], updated seen [S, V])."""
        num_seqs = len(seqs)
        self.num_steps += 1
        bucket = self._buckets[next(b for b in self.buckets if b >= num_seqs)]
        bucket.ctx.fill([(s.start_pos, s.page_ids) for s in seqs])
        bucket.inputs[:num_seqs].copy_(inputs)
        bucket.positions[:num_seqs].copy_(torch.tensor(list(positions)))
        bucket.positions[num_seqs:].zero_()
        bucket.seen[:num_seqs].copy_(seen)
        if bucket.noise is not None:
            if noise is None:
                raise ValueError("a sampled talker's decode graph needs the step's pre-drawn noise")
            bucket.noise.code0[:num_seqs].copy_(noise.code0)
            bucket.noise.residual[:num_seqs].copy_(noise.residual)
        if bucket.graph is not None:
            bucket.graph.replay()
            out = bucket.out
        else:
            out = self._step_fn(bucket)
        assert out is not None
        return out.codes[:num_seqs].clone(), out.next_input_embeds[:num_seqs].clone(), bucket.seen[:num_seqs].clone()

    def _step(self, bucket: _Bucket) -> TalkerPagedStep:
        size = bucket.inputs.shape[0]
        return step_paged(self.talker, bucket.inputs, bucket.positions, bucket.ctx, bucket.rows, bucket.text_vec,
                          bucket.seen, [self.sampling] * size, [None] * size, noise=bucket.noise)

    def _capture(self, bucket: _Bucket) -> None:
        # NOTE: the buffers start as padding (the scratch page), so warm-up and capture write only there.
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):  # NOTE: lazy tables and allocator pools settle before capture
                self._step(bucket)
        torch.cuda.current_stream().wait_stream(stream)
        bucket.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(bucket.graph):
            bucket.out = self._step(bucket)
