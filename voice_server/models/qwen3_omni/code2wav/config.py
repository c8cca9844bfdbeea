"""Code2Wav configuration, read from the `code2wav_config` block of the checkpoint's config.json."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from voice_server.models.hf_config import HFSection, as_section, check_positive, read_rope


@dataclass(frozen=True)
class Code2WavConfig:
    codebook_size: int = 2048
    num_quantizers: int = 16
    hidden_size: int = 1024
    intermediate_size: int = 3072
    num_hidden_layers: int = 8
    num_attention_heads: int = 16
    num_key_value_heads: int = 16
    # Causal sliding attention window in frames (a query sees itself and the previous window - 1).
    sliding_window: int = 72
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-5
    layer_scale_initial_scale: float = 0.01
    attention_bias: bool = False
    hidden_act: str = "silu"
    # Decoder blocks (SnakeBeta + transposed conv + 3 residual units), applied after `upsampling_ratios`.
    upsample_rates: tuple[int, ...] = (8, 5, 4, 3)
    # ConvNeXt upsampling stages between the transformer and the decoder.
    upsampling_ratios: tuple[int, ...] = (2, 2)
    decoder_dim: int = 1536
    sample_rate: int = 24000

    def __post_init__(self) -> None:
        check_positive(self, "codebook_size", "num_quantizers", "hidden_size", "intermediate_size",
                       "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "sliding_window",
                       "decoder_dim", "sample_rate")
        if self.hidden_size % self.num_attention_heads != 0:
            raise ValueError(f"Code2WavConfig.hidden_size={self.hidden_size} is not a multiple of "
                             f"num_attention_heads={self.num_attention_heads}")
        if self.num_attention_heads % self.num_key_value_heads != 0:
            raise ValueError(f"Code2WavConfig.num_attention_heads={self.num_attention_heads} is not a "
                             f"multiple of num_key_value_heads={self.num_key_value_heads}")
        if self.hidden_act != "silu":
            raise ValueError(f"Code2WavConfig.hidden_act={self.hidden_act!r}: only 'silu' is supported")
        if not self.upsample_rates or any(r < 1 for r in self.upsample_rates):
            raise ValueError(f"Code2WavConfig.upsample_rates must be non-empty and >= 1, "
                             f"got {self.upsample_rates}")
        if any(r < 1 for r in self.upsampling_ratios):
            raise ValueError(f"Code2WavConfig.upsampling_ratios must be >= 1, got {self.upsampling_ratios}")
        if self.decoder_dim % 2 ** len(self.upsample_rates) != 0:
            raise ValueError(f"Code2WavConfig.decoder_dim={self.decoder_dim} must be divisible by "
                             f"2**len(upsample_rates)={2 ** len(self.upsample_rates)}")
        check_positive(self, "rope_theta", "rms_norm_eps")

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @property
    def total_upsample(self) -> int:
        """PCM samples per codec frame (1920 for the released model: 24 kHz / 12.5 Hz)."""
        return math.prod(self.upsample_rates) * math.prod(self.upsampling_ratios)

    @classmethod
    def from_hf_dict(cls, d: Mapping[str, Any] | HFSection) -> Code2WavConfig:
        """Build from the HF `code2wav_config` dict; unknown keys are ignored, missing ones take the
        released model's values (which are also the HF class defaults)."""
        s = as_section(d, "code2wav_config")
        kwargs = s.read_fields(cls)
        kwargs["rope_theta"] = read_rope(s, cls.rope_theta).theta
        return cls(**kwargs)
