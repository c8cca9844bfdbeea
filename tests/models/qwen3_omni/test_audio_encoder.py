"""Audio encoder vs transformers' Qwen3OmniMoeAudioEncoder (the thinker's audio tower), tiny random fp32."""

from __future__ import annotations

import pytest
import torch
from transformers.models.qwen3_omni_moe.configuration_qwen3_omni_moe import (
    Qwen3OmniMoeAudioEncoderConfig,
)
from transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe import (
    Qwen3OmniMoeAudioEncoder,
    _get_feat_extract_output_lengths,
)

from voice_server.models.qwen3_omni.audio.encoder import AudioEncoder, conv_output_lengths, num_audio_tokens
from voice_server.models.qwen3_omni.thinker.config import AudioEncoderConfig

torch.set_num_threads(1)


def _tiny_dict(n_window_infer: int) -> dict:
    return dict(
        d_model=16, encoder_attention_heads=2, encoder_ffn_dim=32, encoder_layers=2, num_mel_bins=16,
        downsample_hidden_size=8, output_dim=24, n_window=50, n_window_infer=n_window_infer,
    )


@torch.no_grad()
def _randomize_(model: torch.nn.Module, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    for name, p in sorted(model.named_parameters()):
        r = torch.randn(p.shape, generator=g)
        p.copy_(1.0 + 0.1 * r if p.ndim == 1 and "norm" in name else 0.2 * r)


def _pair(n_window_infer: int) -> tuple[AudioEncoder, Qwen3OmniMoeAudioEncoder]:
    d = _tiny_dict(n_window_infer)
    ref = Qwen3OmniMoeAudioEncoder(Qwen3OmniMoeAudioEncoderConfig(**d)).eval()
    _randomize_(ref, seed=n_window_infer)
    ours = AudioEncoder(AudioEncoderConfig.from_hf_dict(d)).eval()
    ours.load_state_dict(ref.state_dict(), strict=True)
    return ours, ref


@pytest.mark.parametrize(
    ("n_window_infer", "lengths"),
    [
        (200, [100]),
        (200, [57]),
        (200, [250]),  # 3 chunks, windows of 26 tokens: 26 + 7
        (200, [613]),  # not a multiple of the window or the chunk
        (200, [130, 47, 300]),  # several clips in one call, windows never cross clips
        (800, [950]),  # released window (104 tokens) split into 104 + 20
        (800, [99, 1001]),
    ],
)
@torch.no_grad()
def test_audio_encoder_matches_hf(n_window_infer: int, lengths: list[int]) -> None:
    ours, ref = _pair(n_window_infer)
    g = torch.Generator().manual_seed(sum(lengths))
    feats = torch.randn(16, sum(lengths), generator=g)
    feature_lens = torch.tensor(lengths)
    expected = ref(input_features=feats, feature_lens=feature_lens).last_hidden_state
    got = ours(feats, feature_lens)
    assert got.shape == expected.shape == (int(conv_output_lengths(feature_lens).sum()), 24)
    err = (got - expected).abs().max().item()
    assert err <= 1e-4, err


def test_token_counts_match_hf_rule() -> None:
    frames = torch.arange(1, 3001)
    assert torch.equal(conv_output_lengths(frames), _get_feat_extract_output_lengths(frames))
    assert num_audio_tokens(100) == 13 and num_audio_tokens(3000) == 390


def test_feature_length_mismatch_is_rejected() -> None:
    ours, _ = _pair(200)
    with pytest.raises(ValueError, match="feature_lens"):
        ours(torch.zeros(16, 90), torch.tensor([100]))


def test_meta_device_construction_has_no_buffers() -> None:
    with torch.device("meta"):
        enc = AudioEncoder(AudioEncoderConfig())
    assert list(enc.buffers()) == []
    assert all(p.is_meta for p in enc.parameters())


@torch.no_grad()
def test_full_chunk_padding_equals_the_reference_next_to_a_long_clip() -> None:
    # A sub-second clip padded to a full chunk gets the tokens the reference gives it in a call that
    # also holds a clip of >= 1 s (whose chunks set the padded length), whatever else is in the call.
    ours, ref = _pair(200)
    g = torch.Generator().manual_seed(5)
    short, long_ = torch.randn(16, 57, generator=g), torch.randn(16, 130, generator=g)
    expected = ref(input_features=torch.cat([short, long_], 1), feature_lens=torch.tensor([57, 130])).last_hidden_state
    got = ours(short, torch.tensor([57]), chunk_pad_len=100)
    num_short = num_audio_tokens(57)
    assert (got - expected[:num_short]).abs().max().item() <= 1e-4
    assert (ours(short, torch.tensor([57])) - got).abs().max().item() > 1e-4  # the reference pads to 57 alone
