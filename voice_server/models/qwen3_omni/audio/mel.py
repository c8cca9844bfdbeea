"""16 kHz log-mel front end of the Qwen3-Omni audio encoder, in torch (no torchaudio, no librosa).

Equal to transformers' `WhisperFeatureExtractor(feature_size=128)` called the way the Qwen3-Omni
processor calls it (`padding=True` i.e. pad to the longest clip with zeros on the right,
`truncation=False`, `return_attention_mask=True`): the same STFT (centred, reflect-padded, periodic
Hann), the same Slaney mel bank, the same per-clip dynamic-range clamp, and the same frame counts.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch


def _hertz_to_mel_slaney(freq: np.ndarray) -> np.ndarray:
    mels = 3.0 * freq / 200.0
    log_region = freq >= 1000.0
    mels[log_region] = 15.0 + np.log(freq[log_region] / 1000.0) * (27.0 / np.log(6.4))
    return mels


def _mel_to_hertz_slaney(mels: np.ndarray) -> np.ndarray:
    freq = 200.0 * mels / 3.0
    log_region = mels >= 15.0
    freq[log_region] = 1000.0 * np.exp((np.log(6.4) / 27.0) * (mels[log_region] - 15.0))
    return freq


def mel_filter_bank(
    num_frequency_bins: int, num_mel_filters: int, min_frequency: float, max_frequency: float, sampling_rate: int
) -> np.ndarray:
    """Slaney-scale, Slaney-normalised triangular filters [num_frequency_bins, num_mel_filters], float64.

    NOTE: same float64 arithmetic, in the same order, as `transformers.audio_utils.mel_filter_bank(...,
    norm="slaney", mel_scale="slaney")`, so the float32 cast is bit-identical.
    """
    if num_frequency_bins < 2:
        raise ValueError(f"num_frequency_bins must be >= 2, got {num_frequency_bins}")
    if not 0.0 <= min_frequency <= max_frequency:
        raise ValueError(f"need 0 <= min_frequency <= max_frequency, got {min_frequency}, {max_frequency}")
    mel_range = _hertz_to_mel_slaney(np.array([min_frequency, max_frequency], dtype=np.float64))
    mel_freqs = np.linspace(mel_range[0], mel_range[1], num_mel_filters + 2)
    filter_freqs = _mel_to_hertz_slaney(mel_freqs)
    fft_freqs = np.linspace(0, sampling_rate // 2, num_frequency_bins)
    filter_diff = np.diff(filter_freqs)
    slopes = np.expand_dims(filter_freqs, 0) - np.expand_dims(fft_freqs, 1)
    down_slopes = -slopes[:, :-2] / filter_diff[:-1]
    up_slopes = slopes[:, 2:] / filter_diff[1:]
    filters = np.maximum(np.zeros(1), np.minimum(down_slopes, up_slopes))
    enorm = 2.0 / (filter_freqs[2 : num_mel_filters + 2] - filter_freqs[:num_mel_filters])
    return filters * np.expand_dims(enorm, 0)


@dataclass(frozen=True)
class MelFeatures:
    features: torch.Tensor  # [B, num_mel_bins, num_frames] float32, padded to the longest clip
    feature_lens: torch.Tensor  # [B] int64, valid frames per clip (the processor's feature_attention_mask sum)

    @property
    def attention_mask(self) -> torch.Tensor:
        """[B, num_frames] int64, 1 on valid frames (HF's `feature_attention_mask`)."""
        frames = torch.arange(self.features.shape[-1], device=self.feature_lens.device)
        return (frames[None, :] < self.feature_lens[:, None]).long()

    def packed(self) -> torch.Tensor:
        """Valid frames of every clip concatenated along time, [num_mel_bins, sum(feature_lens)]: the
        layout the audio encoder takes (as in HF's `get_audio_features`)."""
        mask = self.attention_mask.bool()
        return self.features.permute(0, 2, 1)[mask].permute(1, 0)


def pcm16_to_float(pcm: bytes | torch.Tensor) -> torch.Tensor:
    """Signed 16-bit little-endian mono PCM -> float32 samples in [-1, 1)."""
    if isinstance(pcm, bytes | bytearray | memoryview):
        pcm = torch.frombuffer(bytearray(pcm), dtype=torch.int16)
    if pcm.dtype != torch.int16:
        raise ValueError(f"pcm must be int16, got {pcm.dtype}")
    return pcm.to(torch.float32) / 32768.0


class LogMelFrontEnd:
    """Raw 16 kHz mono waveforms -> padded log-mel features and per-clip frame counts."""

    def __init__(
        self, num_mel_bins: int = 128, sampling_rate: int = 16000, n_fft: int = 400, hop_length: int = 160
    ) -> None:
        if num_mel_bins <= 0 or n_fft <= 0 or hop_length <= 0:
            raise ValueError(f"num_mel_bins, n_fft, hop_length must be > 0: {num_mel_bins}, {n_fft}, {hop_length}")
        self.num_mel_bins, self.sampling_rate = num_mel_bins, sampling_rate
        self.n_fft, self.hop_length = n_fft, hop_length
        bank = mel_filter_bank(1 + n_fft // 2, num_mel_bins, 0.0, 8000.0, sampling_rate)
        self.mel_filters = torch.from_numpy(bank).to(torch.float32)  # [freq_bins, mels]
        self.window = torch.hann_window(n_fft)

    @property
    def min_num_samples(self) -> int:
        """The shortest clip that can be the longest of its batch (the centred STFT reflect-pads
        n_fft // 2 samples, which needs a longer signal)."""
        return self.n_fft // 2 + 1

    def num_frames(self, num_samples: int) -> int:
        """Frames of a clip of `num_samples` when it is the longest of its batch (HF drops the last STFT frame)."""
        return num_samples // self.hop_length

    def feature_lens(self, num_samples: Sequence[int]) -> list[int]:
        """Valid frames of each clip of one call: a shorter clip keeps its partial last frame (up to the
        longest clip's frame count), so a clip's count depends on the longest clip it is padded to."""
        num_frames = self.num_frames(max(num_samples))
        return [min(num_frames, math.ceil(n / self.hop_length)) for n in num_samples]

    def __call__(self, waveforms: Sequence[torch.Tensor | np.ndarray] | torch.Tensor) -> MelFeatures:
        clips = [torch.as_tensor(w).to(torch.float32).reshape(-1) for w in waveforms]
        if not clips:
            raise ValueError("waveforms is empty")
        lens = [int(c.numel()) for c in clips]
        padded_len = max(lens)
        if padded_len < self.min_num_samples:
            raise ValueError(f"the longest clip has {padded_len} samples; need more than {self.n_fft // 2}")
        batch = torch.zeros(len(clips), padded_len, dtype=torch.float32)
        for i, clip in enumerate(clips):
            batch[i, : lens[i]] = clip
        device = batch.device
        stft = torch.stft(batch, self.n_fft, self.hop_length, window=self.window.to(device), return_complex=True)
        magnitudes = (stft[..., :-1].abs() ** 2).contiguous()
        mel_spec = self.mel_filters.to(device).T @ magnitudes
        log_spec = torch.clamp(mel_spec, min=1e-10).log10()
        # NOTE: the dynamic-range floor is per clip, over its padded frames too (as HF computes it).
        max_val = log_spec.max(dim=2, keepdim=True)[0].max(dim=1, keepdim=True)[0]
        log_spec = (torch.maximum(log_spec, max_val - 8.0) + 4.0) / 4.0
        feature_lens = torch.tensor(self.feature_lens(lens))
        return MelFeatures(features=log_spec, feature_lens=feature_lens)
