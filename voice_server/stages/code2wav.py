"""Code2Wav stage (`code2wav` scheduler): Qwen3-Omni's streaming vocoder behind a `Code2WavRunner`.

factory_args: the common Qwen3-Omni keys (`checkpoint` or `preset`, `seed`, `dtype`,
`num_threads`; see `omni_parts.py`) and
- `left_context_frames` (default: the exact minimum, `conv_context_frames` of the model: 10 for the
  released one): transformer-output frames kept per stream as the conv stacks' left context. HF's
  `chunked_decode` uses 25 because it recomputes the transformer over them; this stage carries each
  stream's KV cache and needs only the conv receptive field. Smaller is cheaper but inexact.

Stage fields read by the scheduler: `initial_chunk_frames`, `chunk_frames`, `max_batch_size`.
"""

from __future__ import annotations

from voice_server.config import PipelineConfig, StageConfig
from voice_server.config.budget import StageMemory
from voice_server.config.errors import fail
from voice_server.engine.runtime import StageContext
from voice_server.models.qwen3_omni.code2wav.model import Code2Wav
from voice_server.runners.code2wav_runner import Code2WavRunner
from voice_server.stages.omni_parts import check_args, read_omni_args

OWN_ARGS = ("left_context_frames",)


def create_code2wav(ctx: StageContext) -> Code2WavRunner:
    args = read_omni_args(ctx, OWN_ARGS)
    left_context_frames = args.int_arg("left_context_frames", None, minimum=1)
    model = args.load("code2wav")
    if not isinstance(model, Code2Wav):
        raise TypeError(f"{args.where}: load('code2wav') gave {type(model).__name__}, not Code2Wav")
    try:
        return Code2WavRunner(model, left_context_frames)
    except ValueError as exc:
        raise fail(args.where, "factory_args.left_context_frames", str(exc)) from exc


def stage_memory(stage: StageConfig, pipeline: PipelineConfig) -> StageMemory:
    """The vocoder's weights, for `check-config` (nothing is loaded; its activations are not planned)."""
    return StageMemory(check_args(stage, pipeline, OWN_ARGS).part_weight_bytes("code2wav"))
