"""Code2Wav parity with transformers' Qwen3OmniMoeCode2Wav (fp32, tiny random config)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from voice_server.models.qwen3_omni.code2wav.config import Code2WavConfig
from voice_server.models.qwen3_omni.code2wav.model import Code2Wav
from voice_server.models.qwen3_omni.code2wav.streaming import conv_context_frames, lookahead_samples

torch.set_num_threads(1)

TINY: dict[str, Any] = dict(
    codebook_size=32, num_quantizers=4, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
    num_attention_heads=2, num_key_value_heads=1, sliding_window=8, decoder_dim=16, upsample_rates=[3, 2],
    upsampling_ratios=[2], max_position_embeddings=512,
    rope_parameters={"rope_type": "default", "rope_theta": 1e4},
)


@torch.no_grad()
def randomize_(model: nn.Module, seed: int) -> None:
    # Every parameter, including the near-trivial ones at HF init (LayerScale 0.01, ConvNeXt gamma 1e-6,
    # SnakeBeta alpha/beta 0), so the parity check exercises every path.
    g = torch.Generator().manual_seed(seed)
    for name, p in sorted(model.named_parameters()):
        r = torch.randn(p.shape, generator=g)
        if name.endswith(("norm.weight", "layernorm.weight")):
            p.copy_(1.0 + 0.1 * r)
        elif name.endswith((".alpha", ".beta")):
            p.copy_(0.3 * r)
        elif name.endswith((".scale", ".gamma")):
            p.copy_(0.3 + 0.1 * r)
        elif name.endswith("code_embedding.weight"):
            p.copy_(r)
        elif p.ndim == 1:  # biases
            p.copy_(0.02 * r)
        else:  # Linear [out, in], Conv1d [out, in, k], ConvTranspose1d [in, out, k]: unit gain
            fan_in = p[0].numel() if "upsample" not in name and ".block.1." not in name else p.shape[0]
            p.copy_(0.5 * r / fan_in**0.5)


def hf_code2wav(d: dict[str, Any], seed: int) -> nn.Module:
    from transformers.models.qwen3_omni_moe.configuration_qwen3_omni_moe import Qwen3OmniMoeCode2WavConfig
    from transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe import Qwen3OmniMoeCode2Wav

    hf = Qwen3OmniMoeCode2Wav(Qwen3OmniMoeCode2WavConfig(**d)).eval()
    randomize_(hf, seed)
    return hf


def test_config_from_hf_dict_and_validation() -> None:
    cfg = Code2WavConfig.from_hf_dict({**TINY, "unknown_field": 1})
    assert cfg.upsample_rates == (3, 2) and cfg.total_upsample == 12 and cfg.head_dim == 8
    released = Code2WavConfig.from_hf_dict({})
    assert released.total_upsample == 1920 and released.sliding_window == 72
    # Held-back lookahead and conv context of the released vocoder (see streaming.py).
    assert lookahead_samples(released) == 555 and conv_context_frames(released) == 10
    with pytest.raises(ValueError, match="num_attention_heads"):
        Code2WavConfig(hidden_size=16, num_attention_heads=3)
    with pytest.raises(ValueError, match="decoder_dim"):
        Code2WavConfig(decoder_dim=100)


# NOTE: the released vocoder's upsampling (1,920 samples per frame, as in the `tiny-full-rate` preset)
# on tiny widths: four decoder blocks instead of two.
FULL_RATE: dict[str, Any] = {**TINY, "upsample_rates": [8, 5, 4, 3], "upsampling_ratios": [2, 2]}


@pytest.mark.parametrize("d", [TINY, FULL_RATE], ids=["tiny", "full-rate"])
def test_parity_with_transformers(d: dict[str, Any]) -> None:
    hf = hf_code2wav(d, seed=0)
    ours = Code2Wav(Code2WavConfig.from_hf_dict(d)).eval()
    upsample = ours.cfg.total_upsample
    hf_sd = hf.state_dict()
    assert set(ours.state_dict()) == set(hf_sd)
    ours.load_state_dict(hf_sd, strict=True)
    codes = torch.randint(0, 32, (2, 4, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref, out = hf(codes), ours(codes)
    assert out.shape == ref.shape == (2, 1, 40 * upsample - lookahead_samples(ours.cfg))
    # The clamp to [-1, 1] must not hide the signal, else the comparison is vacuous.
    assert (ref.abs() < 1).float().mean() > 0.5 and ref.std() > 0.05
    err = (out - ref).abs().max().item()
    print(f"code2wav fp32 max abs err vs transformers: {err:.2e}")
    assert err <= 1e-4
    # The reference's chunked_decode loses the lookahead samples at the end of every chunk (here 4
    # chunks); our decode_chunk does not (test_code2wav_streaming.py).
    with torch.no_grad():
        chunked = hf.chunked_decode(codes, chunk_size=10, left_context_size=5)
    assert chunked.shape[-1] == 40 * upsample - 4 * lookahead_samples(ours.cfg)


def test_meta_construction_has_no_buffers() -> None:
    with torch.device("meta"):
        model = Code2Wav(Code2WavConfig())
    assert all(p.is_meta for p in model.parameters())
    assert sum(p.numel() for p in model.parameters()) == 216_016_577  # released size (reference notes)
    assert not list(model.buffers())
