"""`DecoderRunner`: the torch side of an `ar` stage for a `LlamaForCausalLM` over a paged KV cache.

One `execute` is one forward over the flat tokens of every sequence in the batch (prefill chunks
and decode tokens together), then one vectorised sampling of the sequences that sample, then one
`.tolist()` of the sampled ids: the only host sync of the step.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from voice_server.models.llama import GGUFTokenizer, LlamaConfig, LlamaForCausalLM
from voice_server.models.paged import AttentionContext, PagedKVCache, build_attention_context, decode_kernel_usable
from voice_server.models.quant import LINEAR_TYPES
from voice_server.runners.admission import AdmissionRules, admit
from voice_server.runners.compiled import CompiledDecodeStep
from voice_server.runners.detok import Detokenizer, Piece, token_bytes_table
from voice_server.runners.row_plan import RowPlan, plan_rows
from voice_server.runners.sampler import Sampler
from voice_server.runners.sizing import KVPlan, activation_reserve_bytes, plan_kv_cache, weight_bytes
from voice_server.scheduling import Runner, WorkItem
from voice_server.scheduling.contract import ARBatch, ARResult, ARSeq, ARSpec, SamplingParams, SeqOutput

log = logging.getLogger(__name__)


KV_CACHE_DTYPES = ("auto", "model", "fp16")


@dataclass(frozen=True)
class DecoderRunnerConfig:
    budget_bytes: int
    """Memory for weights, KV cache and activations."""
    page_size: int = 16
    max_model_len: int | None = None
    """None: the model's max_position_embeddings (always capped by it and by the cache)."""
    max_step_tokens: int = 512
    """Most tokens one step computes (sizes the activation reserve)."""
    max_num_seqs: int = 8
    """Most sequences one step samples (sizes the logits part of the reserve)."""
    sampling_defaults: SamplingParams = SamplingParams()
    is_batch_invariant: bool = True
    """Pad every step's rows as the start-up probe finds row-independent (`RowPlan`), so a sequence
    gives the same logits alone and in any batch (costs single-stream decode speed). Where no padding
    does it on this CPU's BLAS the runner batches anyway, with one warning (`row_plan`)."""
    sampler_seed: int | None = None
    """Seeds the generators of requests that give no seed (None: nondeterministic)."""
    kv_cache_dtype: str = "auto"
    """`auto`: fp16 where the model's layers run as one C++ call per step (w4a8 on an AVX512 CPU:
    half the cache memory and half the attention's memory traffic, llama.cpp's default), else `model`;
    `model`: the residual stream's dtype; `fp16`: refused where the fused layers do not run."""
    compile: bool = False
    """Run steps of one decode row (single-stream decode) through `CompiledDecodeStep`, compiled by
    AOTInductor at start-up (~30 s; the weights are held twice, and the KV sizing counts them twice;
    inductor's cache under `inductor_cache_dir()`); other steps stay eager. Same greedy ids, but the
    logits are not always bit-identical to eager ones: a compiled runner is not batch invariant."""

    def __post_init__(self) -> None:
        for name in ("budget_bytes", "page_size", "max_step_tokens", "max_num_seqs"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"DecoderRunnerConfig.{name} must be an integer >= 1, got {value!r}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(
                f"DecoderRunnerConfig.kv_cache_dtype must be one of {KV_CACHE_DTYPES}, got {self.kv_cache_dtype!r}"
            )
        if self.max_model_len is not None and (
            isinstance(self.max_model_len, bool) or not isinstance(self.max_model_len, int) or self.max_model_len < 2
        ):
            raise ValueError(f"DecoderRunnerConfig.max_model_len must be an integer >= 2, got {self.max_model_len!r}")


def kv_cache_dtype_for(model: nn.Module, residual_dtype: torch.dtype, device: torch.device,
                       kv_cache_dtype: str = "auto", is_compiled: bool = False) -> torch.dtype:
    """The KV cache's dtype for `model` (`DecoderRunnerConfig.kv_cache_dtype`)."""
    # NOTE: only the fused layers write and read an fp16 cache under fp32 activations; a compiled
    # step reads the cache in the residual dtype.
    is_half_ok = (
        isinstance(model, LlamaForCausalLM) and not is_compiled and residual_dtype == torch.float32
        and decode_kernel_usable(torch.float16, device) and model.fused_layers() is not None
    )
    if kv_cache_dtype == "fp16" and not is_half_ok:
        raise ValueError("DecoderRunnerConfig.kv_cache_dtype: fp16 needs the fused C++ layers (a w4a8 "
                         "Llama-family model with fp32 activations on an AVX512 CPU, compile off)")
    return torch.float16 if is_half_ok and kv_cache_dtype != "model" else residual_dtype


@dataclass(frozen=True)
class DecoderShape:
    """What the runner needs to know of a decoder to size and run its paged KV cache."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    hidden_size: int
    intermediate_size: int
    """Widest MLP activation (sizes the activation reserve)."""
    vocab_size: int
    max_position_embeddings: int
    eos_token_ids: tuple[int, ...]

    @classmethod
    def of_llama(cls, cfg: LlamaConfig) -> DecoderShape:
        if cfg.layer_types and "sliding_attention" in cfg.layer_types:
            raise ValueError("DecoderRunner: sliding-window attention layers are not supported by the paged cache")
        return cls(cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim, cfg.hidden_size,
                   cfg.intermediate_size, cfg.vocab_size, cfg.max_position_embeddings, tuple(cfg.eos_token_ids))


class DecoderRunner(Runner[ARBatch, ARResult]):
    """The one AR step loop. Subclasses for other decoders (the Qwen3-Omni thinker) override
    `_forward` (what the rows are fed) and `_output_data` (what streams out with each token)."""

    def __init__(
        self,
        model: nn.Module,
        tokenizer: GGUFTokenizer | None,
        config: DecoderRunnerConfig,
        shape: DecoderShape | None = None,
        norm_weight: torch.Tensor | None = None,
    ) -> None:
        if shape is None:
            assert isinstance(model, LlamaForCausalLM)
            shape = DecoderShape.of_llama(model.config)
            norm_weight = model.model.norm.weight
        assert norm_weight is not None, "a non-Llama decoder names its final norm weight"
        cfg = shape
        self.model, self.tokenizer, self.config, self.shape = model, tokenizer, config, shape
        # NOTE: the final norm's dtype is the residual stream's (quantised models hold int8/int4
        # weights next to it), which the KV cache takes unless it is fp16 (`kv_cache_dtype`).
        self.device, self.dtype = norm_weight.device, norm_weight.dtype
        elem = norm_weight.element_size()
        kv_dtype = kv_cache_dtype_for(model, self.dtype, self.device, config.kv_cache_dtype, config.compile)
        # NOTE: a compiled decode step holds the weights a second time, as constants of its library.
        num_weight_bytes = weight_bytes(model) * (2 if config.compile else 1)
        self.plan: KVPlan = plan_kv_cache(
            budget_bytes=config.budget_bytes,
            weight_bytes=num_weight_bytes,
            reserve_bytes=activation_reserve_bytes(
                config.max_step_tokens,
                config.max_num_seqs,
                cfg.hidden_size,
                cfg.intermediate_size,
                cfg.vocab_size,
                elem,
            ),
            bytes_per_page=PagedKVCache.bytes_per_page(
                cfg.num_layers, config.page_size, cfg.num_kv_heads, cfg.head_dim, kv_dtype
            ),
            page_size=config.page_size,
            max_model_len=min(config.max_model_len or cfg.max_position_embeddings, cfg.max_position_embeddings),
        )
        self.cache = PagedKVCache(
            cfg.num_layers,
            self.plan.num_pages,
            config.page_size,
            cfg.num_kv_heads,
            cfg.head_dim,
            kv_dtype,
            self.device,
        )
        eos = list(cfg.eos_token_ids)
        if tokenizer is not None and tokenizer.eos_token_id is not None and tokenizer.eos_token_id not in eos:
            eos.append(int(tokenizer.eos_token_id))
        self.ar_spec = ARSpec(
            num_pages=self.plan.num_pages,
            page_size=config.page_size,
            max_model_len=self.plan.max_model_len,
            eos_token_ids=tuple(eos),
        )
        # NOTE: the head sees one row per sampling sequence, the layers every token of the step: probed
        # apart, the head only up to max_num_seqs rows (its probe is the costly one, a vocabulary wide).
        head = getattr(model, "lm_head", None)
        head = head if isinstance(head, LINEAR_TYPES) else None
        linears = [m for m in model.modules() if isinstance(m, LINEAR_TYPES) and m is not head]
        wanted = config.is_batch_invariant
        self.row_plan: RowPlan = plan_rows(linears, self.dtype, config.max_step_tokens, is_wanted=wanted)
        self.head_plan: RowPlan = self.row_plan if head is None else plan_rows(
            [head], self.dtype, config.max_num_seqs, is_wanted=wanted and self.row_plan.is_batch_invariant)
        self.rules = AdmissionRules(
            vocab_size=cfg.vocab_size,
            max_model_len=self.plan.max_model_len,
            sampling_defaults=config.sampling_defaults,
            encode=tokenizer.encode if tokenizer is not None else None,
            encode_chat=tokenizer.encode_chat if tokenizer is not None else None,
        )
        self.sampler = Sampler(config.sampler_seed)
        self.detok = Detokenizer(token_bytes_table(tokenizer.tokenizer)) if tokenizer is not None else None
        self.decode_step: CompiledDecodeStep | None = None
        if isinstance(model, LlamaForCausalLM):
            model.signed_rope_table(self.device, self.dtype)  # NOTE: built now, not inside the first request
            is_fused = self.cache.use_decode_kernel and model.fused_layers() is not None
            if is_fused and config.compile:
                log.warning("compile: true on a model whose layers run as one C++ call per step (w4a8): the "
                            "compiled graph decodes a lone stream slower (SmolLM2-135M: 207 vs 321 tok/s)")
            self.decode_step = CompiledDecodeStep(model, self.cache) if config.compile else None
        elif config.compile:
            raise ValueError("compile: only Llama-family decoders have a compiled decode step")
        log.info(
            "KV cache: %d pages x %d tokens = %d tokens (%s, %.0f MiB; weights %.0f MiB, reserve %.0f MiB), "
            "max_model_len %d, steps of %s (head: %s)",
            self.plan.num_pages,
            self.plan.page_size,
            self.plan.num_tokens,
            str(kv_dtype).removeprefix("torch."),
            self.plan.kv_bytes / 2**20,
            self.plan.weight_bytes / 2**20,
            self.plan.reserve_bytes / 2**20,
            self.plan.max_model_len,
            self.row_plan.describe(),
            self.head_plan.describe(),
        )

    @property
    def is_batch_invariant(self) -> bool:
        return self.row_plan.is_batch_invariant and self.head_plan.is_batch_invariant

    def facts(self) -> dict[str, bool | int | str]:
        return {"batch_invariant": self.is_batch_invariant, "step_rows": self.row_plan.describe()}

    def stats(self) -> dict[str, int]:
        return {"batch_invariant": int(self.is_batch_invariant)}

    def admit(self, item: WorkItem) -> WorkItem:
        return admit(item, self.rules)

    def release(self, request_id: str) -> None:
        self.sampler.release(request_id)
        if self.detok is not None:
            self.detok.release(request_id)

    @torch.inference_mode()
    def execute(self, batch: ARBatch) -> ARResult:
        self._check(batch)
        seqs = batch.seqs
        num_tokens = batch.num_tokens
        num_rows = self.row_plan.num_rows(num_tokens)
        ids: list[int] = [t for s in seqs for t in s.token_ids]
        ids.extend([0] * (num_rows - num_tokens))
        ctx, positions = build_attention_context(
            self.cache, [(s.start_pos, len(s.token_ids), s.page_ids) for s in seqs], num_rows, self.device
        )
        sampling_rows: list[int] = []
        last_row = -1
        for seq in seqs:
            last_row += len(seq.token_ids)
            if seq.is_sampling:
                sampling_rows.append(last_row)
        if not sampling_rows:
            self._forward(seqs, ids, positions, ctx, [0] * self.head_plan.num_rows(1))
            return ARResult(tuple(SeqOutput(None) for _ in seqs))
        # NOTE: the lm_head is a matrix product too: pad its rows like the step's.
        num_logits_rows = self.head_plan.num_rows(len(sampling_rows))
        logits_rows = sampling_rows + [sampling_rows[-1]] * (num_logits_rows - len(sampling_rows))
        logits = self._forward(seqs, ids, positions, ctx, logits_rows)[: len(sampling_rows)]
        sampling = [s for s in seqs if s.is_sampling]
        draw = self.sampler.draw(
            logits,
            [s.request_id for s in sampling],
            [s.sampling for s in sampling],
            # NOTE: the scheduler sets `history` exactly when the repetition penalty needs it.
            [s.history for s in sampling],
        )
        it = iter(draw.token_ids.tolist())
        outputs: list[SeqOutput] = []
        pieces: list[tuple[ARSeq, Piece | None]] = []
        for seq in seqs:
            if not seq.is_sampling:
                outputs.append(SeqOutput(None))
                continue
            token = int(next(it))
            piece = self.detok.decode(seq.request_id, token) if self.detok is not None else None
            text = piece.text if piece is not None else ""
            outputs.append(SeqOutput(token, text, self._output_data(seq, token)))
            pieces.append((seq, piece))
        # NOTE: per-request state moves only now that nothing of the step can raise: a step that raised
        # is re-run (its requests alone), and must then sample, decode and stream what it would have.
        self.sampler.commit(draw)
        for seq, piece in pieces:
            if self.detok is not None and piece is not None:
                self.detok.commit(seq.request_id, piece)
            self._commit(seq)
        return ARResult(tuple(outputs))

    def _forward(
        self,
        seqs: tuple[ARSeq, ...],
        ids: list[int],
        positions: torch.Tensor,
        ctx: AttentionContext,
        logits_rows: list[int],
    ) -> torch.Tensor:
        """The step's flat rows (`ids`, padding last) -> logits [len(logits_rows), V]."""
        assert isinstance(self.model, LlamaForCausalLM)
        input_ids = torch.tensor(ids, dtype=torch.long, device=self.device)
        if self.decode_step is not None and len(ids) == 1 and logits_rows == [0]:
            return self.decode_step(input_ids, positions, ctx)
        rows = torch.tensor(logits_rows, dtype=torch.long, device=self.device)
        return self.model.forward_paged(input_ids, positions, ctx, rows)

    def _output_data(self, seq: ARSeq, token: int) -> dict[str, Any]:
        """Extra outputs streamed with a sampled token (none for a plain text decoder). Changes no state:
        `_commit` does, once the whole step succeeded."""
        return {}

    def _commit(self, seq: ARSeq) -> None:
        """Advance a sampled sequence's own state past this step, once the whole step succeeded."""

    def _check(self, batch: ARBatch) -> None:
        """Refuse a batch that would write outside the cache or past the model's positions."""
        if not batch.seqs:
            raise ValueError("ARBatch has no sequences")
        ps, num_pages = self.config.page_size, self.plan.num_pages
        for seq in batch.seqs:
            end = seq.start_pos + len(seq.token_ids)
            if not seq.token_ids or seq.start_pos < 0 or end > self.plan.max_model_len:
                raise ValueError(
                    f"request {seq.request_id}: positions [{seq.start_pos}, {end}) "
                    f"outside [0, {self.plan.max_model_len}]"
                )
            if len(seq.page_ids) * ps < end:
                raise ValueError(f"request {seq.request_id}: {len(seq.page_ids)} pages do not cover {end} positions")
            if any(not 0 <= p < num_pages for p in seq.page_ids[: -(-end // ps)]):
                raise ValueError(f"request {seq.request_id}: page id outside [0, {num_pages})")
