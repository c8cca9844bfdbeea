"""Qwen3-Omni thinker stage (`ar` scheduler): `ThinkerRunner` over the MoE thinker.

factory_args: the common Qwen3-Omni keys (`stages/omni_parts.py`: `checkpoint` or `preset`, `seed`,
`dtype`, `num_threads`), plus `page_size` (16), `max_model_len` (the model's), `sampler_seed` (null),
`batch_invariant` (true), and `sampling` (request defaults; greedy with `max_tokens` 256 unless set).
When the stage lists a `stream_to` (the talker), each token streams with what the talker consumes.
With a checkpoint whose folder has `tokenizer.json`, requests may also send `messages`/`prompt` (text
only: audio goes with `token_ids` and its audio blocks) and text deltas stream out; without one
(the tiny preset) only `token_ids` and ids out.
"""

from __future__ import annotations

from voice_server.config import PipelineConfig, StageConfig
from voice_server.config.budget import StageMemory
from voice_server.config.errors import ConfigError, fail
from voice_server.engine.runtime import StageContext
from voice_server.models.paged import PagedKVCache
from voice_server.models.qwen3_omni.thinker.model import ThinkerModel
from voice_server.runners.ar_config import DecoderRunnerConfig
from voice_server.runners.sizing import activation_reserve_bytes
from voice_server.runners.thinker_runner import ThinkerRunner, thinker_shape
from voice_server.scheduling.contract import SamplingParams
from voice_server.stages.llm import load_hf_tokenizer
from voice_server.stages.omni_parts import check_args, read_omni_args

OWN_ARGS = ("page_size", "max_model_len", "sampler_seed", "batch_invariant", "sampling")


def create_thinker(ctx: StageContext) -> ThinkerRunner:
    args = read_omni_args(ctx, OWN_ARGS)
    is_batch_invariant = args.flag_arg("batch_invariant", True)
    try:
        sampling = SamplingParams.from_params({"sampling": args.extra.get("sampling") or {}})
    except ValueError as exc:
        raise fail(args.where, "factory_args.sampling", str(exc)) from exc
    model = args.load("thinker")
    assert isinstance(model, ThinkerModel)
    budget = ctx.memory_budget_bytes()
    config = DecoderRunnerConfig(
        budget_bytes=budget,
        page_size=args.int_arg("page_size", 16, minimum=1) or 16,
        max_model_len=args.int_arg("max_model_len", None, minimum=2),
        max_step_tokens=ctx.stage.max_step_tokens,
        max_num_seqs=ctx.stage.max_batch_size,
        sampling_defaults=sampling,
        is_batch_invariant=is_batch_invariant,
        sampler_seed=args.int_arg("sampler_seed", None, minimum=0),
    )
    tokenizer = load_hf_tokenizer(args.checkpoint) if args.checkpoint is not None else None
    try:
        return ThinkerRunner(model, args.cfg, config, feeds_talker=bool(ctx.stage.stream_to), tokenizer=tokenizer)
    except ValueError as exc:
        raise ConfigError(f"{args.where}: {exc}") from exc


def stage_memory(stage: StageConfig, pipeline: PipelineConfig) -> StageMemory:
    """Weights, the steps' activation reserve and KV bytes per token, as `DecoderRunner` sizes its cache
    (for `check-config`; nothing is loaded)."""
    args = check_args(stage, pipeline, OWN_ARGS)
    shape, elem = thinker_shape(args.cfg), args.dtype.itemsize
    reserve = activation_reserve_bytes(stage.max_step_tokens, stage.max_batch_size, shape.hidden_size,
                                       shape.intermediate_size, shape.vocab_size, elem)
    per_token = PagedKVCache.bytes_per_page(shape.num_layers, 1, shape.num_kv_heads, shape.head_dim, args.dtype)
    return StageMemory(args.part_weight_bytes("thinker"), reserve, per_token)
