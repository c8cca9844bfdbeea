"""Log-mel front end vs transformers' WhisperFeatureExtractor, configured as the Qwen3-Omni processor uses it."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import transformers
from transformers import audio_utils

from voice_server.models.qwen3_omni.audio.mel import LogMelFrontEnd, mel_filter_bank, pcm16_to_float

SR = 16000


def _hf_extractor() -> object:
    # Qwen3-Omni's preprocessor_config: 128 mel bins, 16 kHz, hop 160, n_fft 400, chunk_length 300.
    return transformers.WhisperFeatureExtractor(
        feature_size=128, sampling_rate=SR, hop_length=160, chunk_length=300, n_fft=400, padding_value=0.0,
        return_attention_mask=True,
    )


def _hf_features(clips: list[np.ndarray]) -> tuple[torch.Tensor, torch.Tensor]:
    # The processor's audio kwargs: sampling_rate 16000, padding=True, truncation=False, attention mask on.
    out = _hf_extractor()(
        clips, sampling_rate=SR, padding=True, truncation=False, return_attention_mask=True, return_tensors="pt"
    )
    return out["input_features"], out["attention_mask"]


def _speech_like(num_samples: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    t = np.arange(num_samples) / SR
    f0 = 110.0 + 30.0 * np.sin(2 * math.pi * 3.0 * t)  # gliding pitch
    phase = 2 * math.pi * np.cumsum(f0) / SR
    voiced = sum(np.sin(k * phase) / k for k in range(1, 12))
    envelope = 0.5 * (1 + np.sin(2 * math.pi * 4.0 * t)) ** 2  # syllable-rate amplitude modulation
    sig = 0.1 * voiced * envelope + 0.01 * rng.standard_normal(num_samples)
    sig[num_samples // 3 : num_samples // 3 + 800] = 0.0  # a hard-zero pause (VAD cut)
    return sig.astype(np.float32)


def test_filter_bank_equals_transformers() -> None:
    ours = mel_filter_bank(201, 128, 0.0, 8000.0, SR)
    ref = audio_utils.mel_filter_bank(
        num_frequency_bins=201, num_mel_filters=128, min_frequency=0.0, max_frequency=8000.0,
        sampling_rate=SR, norm="slaney", mel_scale="slaney",
    )
    assert ours.shape == (201, 128)
    np.testing.assert_array_equal(ours, ref)


@pytest.mark.parametrize(
    "lengths",
    [[16000], [16160], [12345], [401], [8000, 16000], [16000, 3210, 9999]],
)
def test_log_mel_equals_whisper_extractor_random(lengths: list[int]) -> None:
    rng = np.random.default_rng(sum(lengths))
    clips = [(0.3 * rng.standard_normal(n)).astype(np.float32) for n in lengths]
    ref_feats, ref_mask = _hf_features(clips)
    mel = LogMelFrontEnd()(clips)
    assert mel.features.shape == ref_feats.shape
    assert torch.equal(mel.attention_mask, ref_mask.long())
    assert torch.equal(mel.feature_lens, ref_mask.sum(-1).long())
    err = (mel.features - ref_feats).abs().max().item()
    assert err <= 1e-4, err


@pytest.mark.parametrize("lengths", [[24000], [20000, 7777]])
def test_log_mel_equals_whisper_extractor_speech_like(lengths: list[int]) -> None:
    clips = [_speech_like(n, seed=i) for i, n in enumerate(lengths)]
    ref_feats, ref_mask = _hf_features(clips)
    mel = LogMelFrontEnd()(clips)
    assert torch.equal(mel.feature_lens, ref_mask.sum(-1).long())
    err = (mel.features - ref_feats).abs().max().item()
    assert err <= 1e-4, err


def test_packed_layout_matches_processor_masking() -> None:
    clips = [_speech_like(n, seed=3) for n in (4800, 3300)]
    ref_feats, ref_mask = _hf_features(clips)
    packed = LogMelFrontEnd()(clips).packed()
    ref_packed = ref_feats.permute(0, 2, 1)[ref_mask.bool()].permute(1, 0)
    assert packed.shape == ref_packed.shape == (128, 30 + math.ceil(3300 / 160))
    assert (packed - ref_packed).abs().max().item() <= 1e-4


def test_pcm16_bytes_are_scaled_like_float_input() -> None:
    pcm = (np.sin(np.arange(3200) / 7.0) * 12000).astype("<i2")
    wav = pcm16_to_float(pcm.tobytes())
    np.testing.assert_allclose(wav.numpy(), pcm.astype(np.float32) / 32768.0)
    with pytest.raises(ValueError, match="int16"):
        pcm16_to_float(torch.zeros(4))


def test_too_short_clip_is_rejected() -> None:
    with pytest.raises(ValueError, match="more than 200"):
        LogMelFrontEnd()([np.zeros(150, dtype=np.float32)])
