"""Streaming Code2Wav: `decode_chunk(codes, state)` whose concatenated output equals full decode.

Design (why it is exact, and cheap):
- Transformer: carried KV cache. Every layer is causal with a sliding window of W frames, so the
  keys/values of the last W - 1 frames are exactly what any later query can see; the cache is trimmed
  to that after each chunk and RoPE positions continue from `num_frames`. Recomputing instead would
  need num_layers * (W - 1) frames of code history (568 for the released model) per chunk.
- Conv stacks: recomputed over `left_context_frames` frames of transformer output kept in the state.
  Their receptive field is short (10 frames for the released model; `conv_context_frames`), so
  recomputing is simpler than carrying per-conv caches and transposed-conv overlap tails. Each stage
  drops the left context the remaining stages no longer need (`Code2Wav.decode_hidden(first_sample)`),
  so the high-rate decoder blocks, where most FLOPs are, see only a few samples of it.
- Lookahead: the decoder's transposed convs are trimmed on both sides by the reference, so output
  sample n also sees input floor(n / stride) + 1, and a full decode of T frames returns only
  T * U - lookahead samples (U = total_upsample; lookahead = 555 for the released model), each final.
  A chunk emits exactly the samples that full decode of the frames so far returns; the call with
  `is_last=True` also emits the trailing `lookahead` samples (what `forward(codes, keep_tail=True)`
  returns: computed without a next frame; the reference drops them).
So the concatenated output equals `forward(codes, keep_tail=True)`, exactly T * U samples, whose first
T * U - lookahead are `forward(codes)`. Per call: T_new * U samples, minus the lookahead on the first
call, plus the lookahead on the last.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from voice_server.models.layers import KVCache
from voice_server.models.qwen3_omni.code2wav.config import Code2WavConfig
from voice_server.models.qwen3_omni.code2wav.convs import RESIDUAL_DILATIONS
from voice_server.models.shapes import expect_shape

if TYPE_CHECKING:
    from voice_server.models.qwen3_omni.code2wav.model import Code2Wav

# (kind, kernel_size incl. dilation, stride) of each module after the transformer, in the order of
# `Code2Wav.conv_ops()`. Only the time span matters: SnakeBeta is pointwise ("conv", 1, 1), a ConvNeXt
# block spans its depthwise k7 conv and a residual unit its dilated k7 conv (its second conv is k1).
Stage = tuple[str, int, int]


def conv_stages(cfg: Code2WavConfig) -> list[Stage]:
    stages: list[Stage] = []
    for ratio in cfg.upsampling_ratios:
        stages += [("tconv", ratio, ratio), ("conv", 7, 1)]
    stages.append(("conv", 7, 1))
    for rate in cfg.upsample_rates:
        stages += [("conv", 1, 1), ("tconv", 2 * rate, rate)]
        stages += [("conv", 6 * d + 1, 1) for d in RESIDUAL_DILATIONS]
    stages += [("conv", 1, 1), ("conv", 7, 1)]
    return stages


def earliest_input(stage: Stage, n: int) -> int:
    """First input index that output index n of one stage depends on."""
    kind, kernel, stride = stage
    if kind == "conv":
        return n - (kernel - 1)
    # Trimmed transposed conv: output n is raw index n + kernel - stride, fed by inputs i with
    # i * stride <= raw < i * stride + kernel.
    return (n - stride) // stride + 1


def _latest_input(stage: Stage, n: int) -> int:
    kind, kernel, stride = stage
    return n if kind == "conv" else (n + kernel - stride) // stride


def _input_span(stages: list[Stage], n: int) -> tuple[int, int]:
    """First and last transformer frame that output sample n depends on."""
    lo = hi = n
    for stage in reversed(stages):
        lo, hi = earliest_input(stage, lo), _latest_input(stage, hi)
    return lo, hi


def lookahead_samples(cfg: Code2WavConfig) -> int:
    """Samples at the end of the decoded frames that still depend on the next frame; the reference
    trims exactly these from a full decode (555 for the released model)."""
    stages = conv_stages(cfg)
    return sum(1 for n in range(cfg.total_upsample) if _input_span(stages, n)[1] >= 1)


def conv_context_frames(cfg: Code2WavConfig) -> int:
    """Transformer-output frames before a chunk that the conv stacks need to reproduce full decode
    from the first not-yet-emitted sample on (the emission start is always one frame boundary minus
    the lookahead, and the map is shift-invariant by one frame = total_upsample samples)."""
    num_frames = 1 << 20
    first = num_frames * cfg.total_upsample - lookahead_samples(cfg)
    return num_frames - _input_span(conv_stages(cfg), first)[0]


@dataclass
class Code2WavStreamState:
    """Per-stream (or per lock-stepped batch) decoder state; `decode_chunk` updates it in place."""

    batch_size: int
    left_context_frames: int
    lookahead_samples: int
    kv_cache: KVCache
    # Transformer outputs [B, H, <= left_context_frames] of the latest frames (conv left context).
    hidden_context: torch.Tensor | None = None
    num_frames: int = 0
    num_samples_emitted: int = 0
    is_finished: bool = False


def new_stream_state(
    cfg: Code2WavConfig, batch_size: int = 1, left_context_frames: int | None = None
) -> Code2WavStreamState:
    """`left_context_frames` defaults to `conv_context_frames(cfg)`, the smallest exact value; smaller
    values are allowed (cheaper, inexact) down to covering the held-back lookahead samples."""
    lookahead = lookahead_samples(cfg)
    ctx = conv_context_frames(cfg) if left_context_frames is None else left_context_frames
    min_ctx = math.ceil(lookahead / cfg.total_upsample)
    if ctx < min_ctx:
        raise ValueError(f"left_context_frames={ctx} must be >= {min_ctx} to re-emit the "
                         f"{lookahead} held-back lookahead samples")
    return Code2WavStreamState(batch_size, ctx, lookahead, KVCache(cfg.num_hidden_layers))


@torch.no_grad()
def decode_chunk(
    model: Code2Wav, codes: torch.Tensor, state: Code2WavStreamState, is_last: bool = False,
    start_pos: torch.Tensor | None = None,
) -> tuple[torch.Tensor, Code2WavStreamState]:
    """codes [B, G, T_new] (T_new may be 0, e.g. to flush with is_last) -> (pcm [B, n], state).

    n = samples that became final: T_new * U in steady state (see the module note for the ends).
    `start_pos` (long [B]) overrides the RoPE start of each row: rows that are different streams
    whose states agree but for their position (`batched.decode_streams`); default `state.num_frames`.
    """
    if state.is_finished:
        raise RuntimeError("decode_chunk called on a finished stream (is_last was already set)")
    expect_shape("codes", codes, "[B, G, T]", torch.long, {"B": state.batch_size, "G": model.cfg.num_quantizers})
    upsample = model.total_upsample
    window = state.hidden_context
    if codes.shape[-1] > 0:
        positions = state.num_frames if start_pos is None else start_pos
        hidden = model.pre_transformer(model.embed(codes), positions, state.kv_cache).transpose(1, 2)
        window = hidden if window is None else torch.cat((window, hidden), dim=-1)
        state.num_frames += codes.shape[-1]
    emit_end = state.num_frames * upsample - (0 if is_last else state.lookahead_samples)
    emit_end = max(emit_end, state.num_samples_emitted)
    dtype = model.code_embedding.weight.dtype
    pcm = torch.zeros(state.batch_size, 0, dtype=dtype, device=codes.device)
    if window is not None:
        if emit_end > state.num_samples_emitted:
            first = state.num_samples_emitted - (state.num_frames - window.shape[-1]) * upsample
            wav = model.decode_hidden(window, keep_tail=is_last, first_sample=first)
            pcm = wav[:, : emit_end - state.num_samples_emitted]
        state.hidden_context = window[..., max(0, window.shape[-1] - state.left_context_frames) :]
    state.num_samples_emitted = emit_end
    state.is_finished = is_last
    return pcm, state
