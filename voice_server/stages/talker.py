"""Qwen3-Omni talker stage (`ar` scheduler): `TalkerRunner`, fed by the thinker's token stream.

List it in the thinker's `stream_to`, and list the code2wav stage in its own `stream_to`.
factory_args: the common Qwen3-Omni keys (`stages/omni_parts.py`), plus `page_size` (16),
`max_model_len` (32768 positions, at most the model's), `speaker` (`ethan`), `max_frames` (4096, per reply; a request
may lower or raise it with `params.talker.max_frames`), `sampling` (`greedy`, the reference's
`talker_do_sample=False`, default; or `sample`, its sampling defaults) and `sampler_seed` (null).
`cuda_graphs` (`auto`: decode-only steps captured as CUDA graphs per batch-size bucket on CUDA;
`on` also runs their fixed-shape path eagerly on a CPU; `off`) and `graph_max_len`
(4096 positions the graphs cover; longer sequences step eagerly), `graph_buckets` ([1, 2, 4, 8, 16]),
`compile` (false; on a CPU with `cuda_graphs: on`, torch.compile each bucket's step at start-up, the
CPU's stand-in for graph capture). The stage's `prefix_cache` has no effect here: talker inputs are
embeddings, so equal ids need not mean equal keys and values (`ARSpec.is_prefix_cacheable` is false).
The pipeline's voices choose the speaker per response (`params.talker.speaker`); each voice's is checked
against the model's speakers when the stage loads.
"""

from __future__ import annotations

from voice_server.config.budget import StageMemory
from voice_server.config.errors import ConfigError, fail, quoted, show
from voice_server.config.pipeline import PipelineConfig, StageConfig
from voice_server.engine.runtime import StageContext
from voice_server.models.paged import PagedKVCache
from voice_server.models.qwen3_omni.talker.model import Talker
from voice_server.models.qwen3_omni.talker.sampling import TalkerSampling
from voice_server.models.qwen3_omni.turn import talker_rope_layout, turn_token_ids
from voice_server.runners.sizing import activation_reserve_bytes
from voice_server.runners.talker_graphs import DEFAULT_BUCKETS
from voice_server.runners.talker_runner import TalkerRunner, TalkerRunnerConfig
from voice_server.stages.omni_parts import check_args, read_omni_args

OWN_ARGS = ("page_size", "max_model_len", "speaker", "max_frames", "sampling", "sampler_seed", "cuda_graphs",
            "graph_max_len", "graph_buckets", "compile")
SAMPLING = {"greedy": TalkerSampling, "sample": TalkerSampling.hf_sampling}


def create_talker(ctx: StageContext) -> TalkerRunner:
    args = read_omni_args(ctx, OWN_ARGS)
    sampling_name = args.extra.get("sampling", "greedy")
    if sampling_name not in SAMPLING:
        raise fail(args.where, "factory_args.sampling",
                   f"must be one of {', '.join(SAMPLING)}, got {show(sampling_name)}")
    cuda_graphs = args.extra.get("cuda_graphs", "auto")
    if cuda_graphs not in ("auto", "on", "off"):
        raise fail(args.where, "factory_args.cuda_graphs", f"must be auto, on or off, got {show(cuda_graphs)}")
    is_compiled = args.flag_arg("compile", False)
    buckets = args.extra.get("graph_buckets", list(DEFAULT_BUCKETS))
    if not isinstance(buckets, list) or not buckets or any(
            isinstance(b, bool) or not isinstance(b, int) or not 1 <= b <= 1024 for b in buckets):
        raise fail(args.where, "factory_args.graph_buckets", f"must be a list of batch sizes in [1, 1024], "
                   f"got {show(buckets)}")
    speaker = args.extra.get("speaker", "ethan")
    names = [name for name, _ in args.cfg.talker.speaker_ids]
    if not isinstance(speaker, str) or speaker.lower() not in names:
        raise fail(args.where, "factory_args.speaker", f"must be one of {', '.join(names)}, got {show(speaker)}")
    check_voice_speakers(ctx.pipeline, names)
    model = args.load("talker")
    assert isinstance(model, Talker)
    budget = ctx.memory_budget_bytes()
    try:
        config = TalkerRunnerConfig(
            budget_bytes=budget,
            thinker_hidden_size=args.cfg.thinker.text.hidden_size,
            page_size=args.int_arg("page_size", 16, minimum=1) or 16,
            max_step_tokens=ctx.stage.max_step_tokens,
            max_num_seqs=ctx.stage.max_batch_size,
            speaker=speaker,
            max_frames=args.int_arg("max_frames", 4096, minimum=1) or 4096,
            max_model_len=args.int_arg("max_model_len", 32768, minimum=2) or 32768,
            sampling=SAMPLING[sampling_name](),
            seed=args.int_arg("sampler_seed", None, minimum=0),
            decode_graphs=cuda_graphs,
            graph_buckets=tuple(buckets),
            compile=is_compiled,
            graph_max_len=args.int_arg("graph_max_len", 4096, minimum=1) or 4096,
        )
        return TalkerRunner(model, turn_token_ids(args.cfg), config, talker_rope_layout(args.cfg))
    except ValueError as exc:
        raise ConfigError(f"{args.where}: {exc}") from exc


def stage_memory(stage: StageConfig, pipeline: PipelineConfig) -> StageMemory:
    """Weights, the steps' activation reserve and KV bytes per token, as `TalkerRunner` sizes its cache
    (for `check-config`; nothing is loaded)."""
    args = check_args(stage, pipeline, OWN_ARGS)
    cfg, elem = args.cfg.talker, args.dtype.itemsize
    reserve = activation_reserve_bytes(stage.max_step_tokens, stage.max_batch_size, cfg.hidden_size,
                                       cfg.intermediate_size, cfg.vocab_size, elem)
    per_token = PagedKVCache.bytes_per_page(cfg.num_hidden_layers, 1, cfg.num_key_value_heads, cfg.head_dim,
                                            args.dtype)
    return StageMemory(args.part_weight_bytes("talker"), reserve, per_token)


TALKER_PARAMS = ("speaker", "max_frames")
"""What `params.talker` may hold (`TalkerRunner` refuses a request with anything else)."""


def check_voice_speakers(pipeline: PipelineConfig, names: list[str]) -> None:
    """Each voice's `params.talker` is one the runner takes, its `speaker` one of the model's (`names`): a typo
    fails the start, naming the field, rather than every response in that voice."""
    for voice in pipeline.voices:
        field_name = f"voices.{voice.name}.params.talker"
        talker = voice.params.get("talker", {})
        if not isinstance(talker, dict) or not set(talker) <= set(TALKER_PARAMS):
            raise fail(f"pipeline {quoted(pipeline.name)}", field_name,
                       f"must be a mapping with at most {' and '.join(TALKER_PARAMS)}, got {show(talker)}")
        speaker = talker.get("speaker")
        if speaker is not None and (not isinstance(speaker, str) or speaker.lower() not in names):
            raise fail(f"pipeline {quoted(pipeline.name)}", f"{field_name}.speaker",
                       f"must be one of the model's speakers ({', '.join(names)}), got {show(speaker)}")
