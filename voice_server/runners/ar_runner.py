"""`DecoderRunner`: the torch side of an `ar` stage for a `LlamaForCausalLM` over a paged KV cache.

One `execute` is one forward over the flat tokens of every sequence in the batch (prefill chunks
and decode tokens together), then one vectorised sampling of the sequences that sample, then one
`.tolist()` of the sampled ids: the only host sync of the step.

A request whose prompt ends with the user's message may ask how likely the user's words end where they
do (`ARSeq.turn_end_row`): the probability that the next token is the message's end marker or a sentence
end (`TURN_END_MARKS`), from the same forward, streamed as `turn_end_p` with its first token. A speaker cut
off mid-sentence ("i need to buy some") scores ~0, a whole question 0.02-0.9 (SmolLM2-135M,
docs/BENCHMARKS.md): what a session weighs, with the audio's end-of-turn score, to end a spoken turn.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from torch import nn

from voice_server.models.llama import GGUFTokenizer, LlamaForCausalLM
from voice_server.models.paged import AttentionContext, PagedKVCache, build_attention_context
from voice_server.models.quant import LINEAR_TYPES
from voice_server.runners.admission import AdmissionRules, admit
from voice_server.runners.ar_config import DecoderRunnerConfig, DecoderShape, kv_cache_dtype_for
from voice_server.runners.compiled import CompiledDecodeStep
from voice_server.runners.detok import Detokenizer, Piece, token_bytes_table
from voice_server.runners.row_plan import RowPlan, plan_rows
from voice_server.runners.sampler import Sampler
from voice_server.runners.sizing import KVPlan, activation_reserve_bytes, plan_kv_cache, weight_bytes
from voice_server.scheduling import Runner, WorkItem
from voice_server.scheduling.contract import ARBatch, ARResult, ARSeq, ARSpec, SeqOutput

log = logging.getLogger(__name__)

END_OF_MESSAGE = "<|im_end|>"
"""ChatML's end of a message (SmolLM2, Qwen): the chat templates this runner serves."""
TURN_END_MARKS = (".", "?", "!")
"""Tokens that end the user's sentence: a recogniser's transcript has no punctuation, and a whole question
is more often continued by "?" than closed at once."""


def _token_id(tokenizer: GGUFTokenizer | None, text: str) -> int | None:
    return None if tokenizer is None else tokenizer.tokenizer.token_to_id(text)


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
            end_of_message_id=_token_id(tokenizer, END_OF_MESSAGE),
        )
        ends = [_token_id(tokenizer, t) for t in (END_OF_MESSAGE, *TURN_END_MARKS)]
        self.turn_end_ids = [i for i in ends if i is not None]
        self._turn_end_p: dict[str, float] = {}
        """Scores of requests whose scored row came in a step that did not sample them (a prefill chunk)."""
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
        self._turn_end_p.pop(request_id, None)
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
        turn_rows = self._turn_rows(seqs, len(sampling_rows))
        rows = sampling_rows + [row for _, row in turn_rows]
        if not rows:
            self._forward(seqs, ids, positions, ctx, [0] * self.head_plan.num_rows(1))
            return ARResult(tuple(SeqOutput(None) for _ in seqs))
        # NOTE: the lm_head is a matrix product too: pad its rows like the step's.
        num_logits_rows = self.head_plan.num_rows(len(rows))
        logits_rows = rows + [rows[-1]] * (num_logits_rows - len(rows))
        logits = self._forward(seqs, ids, positions, ctx, logits_rows)[: len(rows)]
        turn_end_p = self._turn_end_probabilities(turn_rows, logits[len(sampling_rows):])
        if not sampling_rows:
            self._turn_end_p.update(turn_end_p)
            return ARResult(tuple(SeqOutput(None) for _ in seqs))
        logits = logits[: len(sampling_rows)]
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
            data = self._output_data(seq, token)
            score = turn_end_p.get(seq.request_id, self._turn_end_p.get(seq.request_id))
            outputs.append(SeqOutput(token, text, data if score is None else {**data, "turn_end_p": score}))
            pieces.append((seq, piece))
        # NOTE: per-request state moves only now that nothing of the step can raise: a step that raised
        # is re-run (its requests alone), and must then sample, decode and stream what it would have.
        self.sampler.commit(draw)
        self._turn_end_p.update(turn_end_p)
        for seq, piece in pieces:
            if self.detok is not None and piece is not None:
                self.detok.commit(seq.request_id, piece)
            self._turn_end_p.pop(seq.request_id, None)
            self._commit(seq)
        return ARResult(tuple(outputs))

    def _turn_rows(self, seqs: tuple[ARSeq, ...], num_sampling: int) -> list[tuple[str, int]]:
        """(request id, flat row) of each sequence's scored row (`ARSeq.turn_end_row`) this step."""
        rows: list[tuple[str, int]] = []
        offset = 0
        for seq in seqs:
            if seq.turn_end_row is not None and self.turn_end_ids:
                rows.append((seq.request_id, offset + seq.turn_end_row))
            offset += len(seq.token_ids)
        # NOTE: the head's row plan holds (batch invariance) up to `max_num_seqs` rows: a step that would go
        # past it scores nothing, and that request's first token comes without `turn_end_p` (rare: a full
        # batch sampling while a new prompt's last chunk runs).
        return rows if num_sampling + len(rows) <= self.config.max_num_seqs else []

    def _turn_end_probabilities(self, rows: list[tuple[str, int]], logits: torch.Tensor) -> dict[str, float]:
        if not rows:
            return {}
        probs = torch.softmax(logits.float(), dim=-1)[:, self.turn_end_ids].sum(dim=-1).tolist()
        return {request_id: float(p) for (request_id, _), p in zip(rows, probs)}

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
