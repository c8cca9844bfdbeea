"""Qwen3-Omni encoder stage (`simple` scheduler): 16 kHz PCM or log-mel -> audio embeddings, and with
`vision: true` images and videos -> visual embeddings.

The pipeline's entry: it runs the thinker's audio tower alone (its checkpoint tensors
`thinker.audio_tower.*`, or the preset's dummy draws of those same names), one forward per batch,
and its `next` stage (the thinker) receives `audio_embeds` through the relay, never re-encoding; with
vision, also the thinker's vision tower (`thinker.visual.*`) and `visual_embeds`.
Payload contract: `voice_server/runners/encoder_runner.py`.

Requests may also be chat `messages` (the session layer's), turned into a prompt by the model's chat
template with the checkpoint's tokenizer.json, or the tiny preset's stand-in tokenizer; a checkpoint
without either takes only `token_ids`.

factory_args: the common Qwen3-Omni keys (`stages/omni_parts.py`), plus
- `max_audio_seconds` (600): the longest clip accepted (PCM seconds at 16 kHz, or that many
  seconds of log-mel frames); a longer one is refused at admission, alone.
- `vision` (false): also build the vision tower (~1 GiB of bf16 weights at the released sizes) and take
  `images` and `videos`; without it such requests are refused.
- `activation_budget_mb` (4096, MiB; with `vision` only): the most one vision forward may hold in
  activations (`voice_server/runners/vision_plan.py`). A batch's images and video frames are packed into
  forwards within it, a long video split along time; an item one frame of which needs more is refused
  at admission, alone. At the released sizes in bf16, 4096 MiB takes the processor's largest image (12.8 MP,
  50,176 patches: 1.9 GiB) in one forward and a minute of 1024x768 video at 2 fps in two (it needs 6.8 GiB
  in one). Weights plus this budget
  must fit the stage's memory budget (`memory_fraction`) where it is known at start-up.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from functools import partial
from typing import Any

from voice_server.config import PipelineConfig, StageConfig
from voice_server.config.budget import StageMemory
from voice_server.config.errors import fail, quoted, show
from voice_server.config.fields import Number, read_arg
from voice_server.engine.runtime import StageContext
from voice_server.models.chat_tools import Tool
from voice_server.models.qwen3_omni.audio.encoder import AudioEncoder
from voice_server.models.qwen3_omni.chat import ChatPrompt, Encode, chat_inputs, tiny_encode
from voice_server.models.qwen3_omni.config import Qwen3OmniConfig
from voice_server.models.qwen3_omni.presets import TINY_TEXT_VOCAB
from voice_server.models.qwen3_omni.vision.encoder import VisionEncoder
from voice_server.runners.encoder_runner import DEFAULT_MAX_AUDIO_SECONDS, AudioEncoderRunner, AudioEncoderRunnerConfig
from voice_server.runners.sizing import MIB, weight_bytes
from voice_server.runners.vision_input import VisionInputConfig
from voice_server.stages.llm import load_hf_tokenizer
from voice_server.stages.omni_parts import OmniArgs, check_args, read_omni_args

OWN_ARGS = ("max_audio_seconds", "vision", "activation_budget_mb")
DEFAULT_ACTIVATION_BUDGET_MB = 4096


def create_audio_encoder(ctx: StageContext) -> AudioEncoderRunner:
    if ctx.stage.scheduler != "simple":
        raise fail(f"stage {quoted(ctx.stage.name)}", "scheduler",
                   f"the audio encoder runs under 'simple', got {show(ctx.stage.scheduler)}")
    args = read_omni_args(ctx, OWN_ARGS)
    max_seconds = args.extra.get("max_audio_seconds", DEFAULT_MAX_AUDIO_SECONDS)
    if isinstance(max_seconds, bool) or not isinstance(max_seconds, int | float) \
            or not 0 < max_seconds < math.inf:
        raise fail(args.where, "factory_args.max_audio_seconds", f"must be a number > 0, got {show(max_seconds)}")
    budget_bytes = _activation_budget_bytes(args)
    tower = args.load("audio_tower")
    if not isinstance(tower, AudioEncoder):
        raise TypeError(f"{args.where}: the audio_tower part is a {type(tower).__name__}, not an AudioEncoder")
    vision_tower, vision_config = None, None
    if budget_bytes is not None:
        vision_tower, vision_config = _vision(ctx, args, budget_bytes, weight_bytes(tower))
    encode: Encode | None = None
    tokenizer = load_hf_tokenizer(args.checkpoint) if args.checkpoint is not None else None
    if tokenizer is not None:
        encode = tokenizer.encode
    elif args.cfg.thinker.text.vocab_size == TINY_TEXT_VOCAB:
        encode = tiny_encode  # NOTE: the tiny test config ships no tokenizer (presets.py)
    cfg = args.cfg
    chat = None if encode is None else partial(_chat, cfg=cfg, encode=encode)
    return AudioEncoderRunner(tower, AudioEncoderRunnerConfig.from_thinker(cfg.thinker, max_seconds), chat,
                              vision_tower, vision_config)


def stage_memory(stage: StageConfig, pipeline: PipelineConfig) -> StageMemory:
    """The towers' weights and the vision activation budget, for `check-config` (nothing is loaded)."""
    args = check_args(stage, pipeline, OWN_ARGS)
    budget_bytes = _activation_budget_bytes(args)
    vision_bytes = 0 if budget_bytes is None else args.part_weight_bytes("vision")
    return StageMemory(args.part_weight_bytes("audio_tower") + vision_bytes, budget_bytes)


def _activation_budget_bytes(args: OmniArgs) -> int | None:
    """`activation_budget_mb` in bytes with `vision: true`; None without vision."""
    is_vision = args.flag_arg("vision", False)
    budget_mb = read_arg(args.where, args.extra, "activation_budget_mb", Number(float, minimum=1),
                         DEFAULT_ACTIVATION_BUDGET_MB)
    if not is_vision and "activation_budget_mb" in args.extra:
        raise fail(args.where, "factory_args.activation_budget_mb", "bounds vision forwards; set `vision: true`")
    return int(budget_mb * MIB) if is_vision else None


def _vision(
    ctx: StageContext, args: OmniArgs, budget_bytes: int, audio_weight_bytes: int
) -> tuple[VisionEncoder, VisionInputConfig]:
    tower = args.load("vision")
    if not isinstance(tower, VisionEncoder):
        raise TypeError(f"{args.where}: the vision part is a {type(tower).__name__}, not a VisionEncoder")
    num_bytes = audio_weight_bytes + weight_bytes(tower) + budget_bytes
    # NOTE: a CPU stage's budget is known from the launch; a GPU stage's is read from the device.
    if ctx.budget_bytes is not None or ctx.stage.device != "cpu":
        memory = ctx.memory_budget_bytes()
        if num_bytes > memory:
            raise fail(args.where, "factory_args.activation_budget_mb",
                       f"weights ({(num_bytes - budget_bytes) / MIB:.0f} MiB) and the activation budget "
                       f"({budget_bytes / MIB:.0f} MiB) exceed the stage's memory budget of {memory / MIB:.0f} "
                       "MiB; raise memory_fraction or lower activation_budget_mb")
    return tower, VisionInputConfig.from_thinker(args.cfg.thinker, args.dtype.itemsize, budget_bytes)


def _chat(messages: Any, cfg: Qwen3OmniConfig, encode: Encode, tools: Sequence[Tool] = ()) -> ChatPrompt:
    return chat_inputs(messages, cfg, encode, tools)
