"""Qwen3-Omni audio encoder stage (`simple` scheduler): 16 kHz PCM or log-mel -> audio embeddings.

The pipeline's entry: it runs the thinker's audio tower alone (its checkpoint tensors
`thinker.audio_tower.*`, or the preset's dummy draws of those same names), one forward per batch,
and its `next` stage (the thinker) receives `audio_embeds` through the relay, never re-encoding.
Payload contract: `voice_server/runners/encoder_runner.py`.

Requests may also be chat `messages` (the session layer's), turned into a prompt by the model's chat
template with the checkpoint's tokenizer.json, or the tiny preset's stand-in tokenizer; a checkpoint
without either takes only `token_ids`.

factory_args: the common Qwen3-Omni keys (`stages/omni_parts.py`), plus
- `max_audio_seconds` (600): the longest clip accepted (PCM seconds at 16 kHz, or that many
  seconds of log-mel frames); a longer one is refused at admission, alone.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from functools import partial
from typing import Any

from voice_server.config.errors import fail, quoted, show
from voice_server.engine.runtime import StageContext
from voice_server.models.chat_tools import Tool
from voice_server.models.qwen3_omni.audio.encoder import AudioEncoder
from voice_server.models.qwen3_omni.chat import Encode, chat_prompt, tiny_encode
from voice_server.models.qwen3_omni.config import Qwen3OmniConfig
from voice_server.models.qwen3_omni.presets import TINY_TEXT_VOCAB
from voice_server.runners.encoder_runner import DEFAULT_MAX_AUDIO_SECONDS, AudioEncoderRunner, AudioEncoderRunnerConfig
from voice_server.stages.llm import load_hf_tokenizer
from voice_server.stages.omni_parts import read_omni_args

OWN_ARGS = ("max_audio_seconds",)


def create_audio_encoder(ctx: StageContext) -> AudioEncoderRunner:
    if ctx.stage.scheduler != "simple":
        raise fail(f"stage {quoted(ctx.stage.name)}", "scheduler",
                   f"the audio encoder runs under 'simple', got {show(ctx.stage.scheduler)}")
    args = read_omni_args(ctx, OWN_ARGS)
    max_seconds = args.extra.get("max_audio_seconds", DEFAULT_MAX_AUDIO_SECONDS)
    if isinstance(max_seconds, bool) or not isinstance(max_seconds, int | float) \
            or not 0 < max_seconds < math.inf:
        raise fail(args.where, "factory_args.max_audio_seconds", f"must be a number > 0, got {show(max_seconds)}")
    tower = args.load("audio_tower")
    if not isinstance(tower, AudioEncoder):
        raise TypeError(f"{args.where}: the audio_tower part is a {type(tower).__name__}, not an AudioEncoder")
    encode: Encode | None = None
    tokenizer = load_hf_tokenizer(args.checkpoint) if args.checkpoint is not None else None
    if tokenizer is not None:
        encode = tokenizer.encode
    elif args.cfg.thinker.text.vocab_size == TINY_TEXT_VOCAB:
        encode = tiny_encode  # NOTE: the tiny test config ships no tokenizer (presets.py)
    cfg = args.cfg
    chat = None if encode is None else partial(_chat, cfg=cfg, encode=encode)
    return AudioEncoderRunner(tower, AudioEncoderRunnerConfig.from_thinker(cfg.thinker, max_seconds), chat)


def _chat(
    messages: Any, cfg: Qwen3OmniConfig, encode: Encode, tools: Sequence[Tool] = ()
) -> tuple[list[int], list[Any]]:
    token_ids, clips = chat_prompt(messages, cfg, encode, tools)
    return token_ids, list(clips)
