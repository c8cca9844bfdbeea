"""Streaming Code2Wav: chunked `decode_chunk` output equals full decode, no sample dropped or repeated."""

from __future__ import annotations

import pytest
import torch

from voice_server.models.qwen3_omni.code2wav.config import Code2WavConfig
from voice_server.models.qwen3_omni.code2wav.model import Code2Wav
from voice_server.models.qwen3_omni.code2wav.streaming import conv_context_frames, lookahead_samples
from voice_server.models.qwen3_omni.weights import init_dummy_weights

torch.set_num_threads(1)

CFG = Code2WavConfig(
    codebook_size=32, num_quantizers=4, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
    num_attention_heads=2, num_key_value_heads=1, sliding_window=8, decoder_dim=16, upsample_rates=(3, 2),
    upsampling_ratios=(2,),
)
NUM_FRAMES = 90


@pytest.fixture(scope="module")
def model() -> Code2Wav:
    with torch.device("meta"):
        m = Code2Wav(CFG)
    init_dummy_weights(m, seed=0, dtype=torch.float32)
    return m.eval()


@pytest.fixture(scope="module")
def codes() -> torch.Tensor:
    return torch.randint(0, CFG.codebook_size, (2, CFG.num_quantizers, NUM_FRAMES),
                         generator=torch.Generator().manual_seed(3))


def stream(model: Code2Wav, codes: torch.Tensor, sizes: list[int], left_context_frames: int | None = None,
           flush_empty: bool = False) -> torch.Tensor:
    state = model.new_stream_state(codes.shape[0], left_context_frames)
    upsample, lookahead = model.total_upsample, state.lookahead_samples
    pieces, start = [], 0
    for i, size in enumerate(sizes):
        is_last = i == len(sizes) - 1 and not flush_empty
        num_before = state.num_samples_emitted
        pcm, state = model.decode_chunk(codes[..., start : start + size], state, is_last=is_last)
        # Exactly the samples that became final: the frames so far minus the held-back lookahead.
        expected_end = max(num_before, (start + size) * upsample - (0 if is_last else lookahead))
        assert pcm.shape == (codes.shape[0], expected_end - num_before)
        assert state.num_samples_emitted == expected_end
        pieces.append(pcm)
        start += size
    assert start == codes.shape[-1]
    if flush_empty:
        pcm, state = model.decode_chunk(codes[..., :0], state, is_last=True)
        assert pcm.shape[1] == lookahead
        pieces.append(pcm)
    assert state.is_finished
    return torch.cat(pieces, dim=-1)


def uneven_sizes(seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    sizes, left = [1], NUM_FRAMES - 1
    while left > 0:
        size = min(left, int(torch.randint(1, 12, (1,), generator=g)))
        sizes.append(size)
        left -= size
    return sizes


SCHEDULES = {
    "one_chunk": [NUM_FRAMES],
    "frame_by_frame": [1] * NUM_FRAMES,
    "first_1_then_8": [1] + [8] * 11 + [1],
    "uneven_a": uneven_sizes(0),
    "uneven_b": uneven_sizes(1),
}


@pytest.mark.parametrize("name", list(SCHEDULES))
def test_stream_equals_full_decode(model: Code2Wav, codes: torch.Tensor, name: str) -> None:
    with torch.no_grad():
        full = model(codes)[:, 0]
        full_with_tail = model(codes, keep_tail=True)[:, 0]
    out = stream(model, codes, SCHEDULES[name], flush_empty=name == "uneven_b")
    assert out.shape == (2, NUM_FRAMES * CFG.total_upsample)
    num_final = NUM_FRAMES * CFG.total_upsample - lookahead_samples(CFG)
    assert full.shape[1] == num_final and (full.abs() < 1).float().mean() > 0.5
    assert torch.equal(full_with_tail[:, :num_final], full)
    err = (out - full_with_tail).abs().max().item()
    print(f"{name}: stream vs full decode max abs err {err:.2e}")
    assert err <= 1e-4


def test_short_left_context_is_measurably_inexact(model: Code2Wav, codes: torch.Tensor) -> None:
    # The default left context is the smallest exact one; below it the error is reported, not hidden.
    default = conv_context_frames(CFG)
    with torch.no_grad():
        full = model(codes, keep_tail=True)[:, 0]
    errors = {}
    for ctx in (default - 1, default // 2, 4, -(-lookahead_samples(CFG) // CFG.total_upsample)):
        out = stream(model, codes, SCHEDULES["uneven_a"], left_context_frames=ctx)
        assert out.shape == full.shape
        errors[ctx] = (out - full).abs().max().item()
        print(f"left_context_frames={ctx} (default {default}): max abs err {errors[ctx]:.2e}")
    # NOTE: the far edge of the receptive field contributes little (default - 1 can be ~1e-8), so
    # only the shortest context must show the truncation.
    assert errors[min(errors)] > 1e-3
    with pytest.raises(ValueError, match="left_context_frames"):
        model.new_stream_state(1, left_context_frames=0)


def test_finished_stream_rejects_more_codes(model: Code2Wav, codes: torch.Tensor) -> None:
    state = model.new_stream_state(2)
    _, state = model.decode_chunk(codes[..., :4], state, is_last=True)
    with pytest.raises(RuntimeError, match="finished"):
        model.decode_chunk(codes[..., 4:5], state)


@pytest.mark.parametrize("keep_tail", [False, True])
def test_decode_from_first_sample_skips_only_unneeded_context(model: Code2Wav, keep_tail: bool) -> None:
    hidden = torch.randn(1, CFG.hidden_size, 40, generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        full = model.decode_hidden(hidden, keep_tail)
        for first in (1, 5, 37, 200, 331, full.shape[1] - 1):
            part = model.decode_hidden(hidden, keep_tail, first_sample=first)
            assert part.shape[1] == full.shape[1] - first
            assert (part - full[:, first:]).abs().max() <= 1e-6, first
