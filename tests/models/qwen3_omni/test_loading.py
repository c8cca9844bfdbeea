"""`load_format: dummy` for whole-model turns: no checkpoint, seeded, deterministic."""

from __future__ import annotations

import pytest
import torch

from voice_server.models.qwen3_omni.code2wav.streaming import lookahead_samples
from voice_server.models.qwen3_omni.config import Qwen3OmniConfig
from voice_server.models.qwen3_omni.loading import load_part
from voice_server.models.qwen3_omni.presets import tiny_config_dict, tiny_prompt_ids
from voice_server.models.qwen3_omni.turn import load_turn_models, run_greedy_turn


def test_dummy_tiny_turn_is_deterministic_per_seed() -> None:
    torch.set_num_threads(1)
    cfg = Qwen3OmniConfig.from_hf_dict(tiny_config_dict())
    input_ids = torch.tensor([tiny_prompt_ids(num_user_text=6)])
    results = []
    for seed in (3, 3, 4):
        models = load_turn_models(None, load_format="dummy", cfg=cfg, seed=seed)
        results.append(run_greedy_turn(models, input_ids, max_new_tokens=6, max_codec_frames=6))
    same, other = results[0], results[2]
    assert torch.equal(same.text_ids, results[1].text_ids) and torch.equal(same.codes, results[1].codes)
    assert torch.equal(same.waveform, results[1].waveform)
    assert same.codes.shape[1] == cfg.talker.num_code_groups
    # The reference-style offline decode trims the vocoder's lookahead once (see code2wav/streaming.py).
    num_frames = same.codes.shape[-1]
    assert same.waveform.shape[-1] == num_frames * cfg.code2wav.total_upsample - lookahead_samples(cfg.code2wav)
    assert not torch.equal(same.text_ids, other.text_ids)


def test_load_part_rejects_bad_arguments() -> None:
    cfg = Qwen3OmniConfig.from_hf_dict(tiny_config_dict())
    with pytest.raises(ValueError, match="load_format"):
        load_part("talker", cfg, load_format="pt")
    with pytest.raises(ValueError, match="checkpoint directory"):
        load_part("talker", cfg)
    with pytest.raises(ValueError, match="part must be"):
        load_part("visual", cfg, load_format="dummy")  # type: ignore[arg-type]
