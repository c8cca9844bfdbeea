"""Whole greedy turn (thinker -> talker + MTP -> code2wav) vs transformers' generate(return_audio=True).

The tiny HF model is written with `save_pretrained` (the released on-disk layout: per-expert weights,
`thinker.model.*` / `thinker.audio_tower.*` names) and ours is loaded from that folder through
`weights.load_weights`, so this also proves the checkpoint layout.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from omni_reference import hf_turn, save_reference

from voice_server.models.qwen3_omni.audio.encoder import num_audio_tokens
from voice_server.models.qwen3_omni.audio.mel import LogMelFrontEnd
from voice_server.models.qwen3_omni.presets import tiny_prompt_ids
from voice_server.models.qwen3_omni.turn import TurnModels, load_turn_models, run_greedy_turn

torch.set_num_threads(1)
MAX_NEW_TOKENS = 6
MAX_FRAMES = 7


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> tuple[torch.nn.Module, TurnModels]:
    ckpt: Path = tmp_path_factory.mktemp("tiny_qwen3_omni")
    ref = save_reference(ckpt)
    return ref, load_turn_models(ckpt)


def _hf_turn(ref: torch.nn.Module, input_ids: torch.Tensor, **kwargs: object) -> tuple[torch.Tensor, ...]:
    return hf_turn(ref, MAX_NEW_TOKENS, MAX_FRAMES, input_ids=input_ids, **kwargs)


def _check(ours: object, ref_out: tuple[torch.Tensor, ...]) -> None:
    text_ids, codes, wav = ref_out
    assert torch.equal(ours.text_ids, text_ids)  # type: ignore[attr-defined]
    assert torch.equal(ours.codes, codes)  # type: ignore[attr-defined]
    assert ours.waveform.shape == wav.shape  # type: ignore[attr-defined]
    err = (ours.waveform - wav).abs().max().item()  # type: ignore[attr-defined]
    assert err <= 1e-4, err
    assert codes.shape[-1] > 0 and wav.abs().max() > 1e-3  # the turn produced real audio


def test_text_prompt_turn_matches_hf(models: tuple[torch.nn.Module, TurnModels]) -> None:
    ref, ours = models
    input_ids = torch.tensor([tiny_prompt_ids(num_user_text=6)])
    torch.manual_seed(0)
    ref_out = _hf_turn(ref, input_ids)
    got = run_greedy_turn(ours, input_ids, MAX_NEW_TOKENS, MAX_FRAMES)
    _check(got, ref_out)
    assert got.text_ids.shape[1] > input_ids.shape[1] + 1


def test_audio_prompt_turn_matches_hf(models: tuple[torch.nn.Module, TurnModels]) -> None:
    ref, ours = models
    rng = np.random.default_rng(5)
    t = np.arange(19_000) / 16000
    pcm = (0.3 * np.sin(2 * np.pi * 220 * t) * (1 + np.sin(2 * np.pi * 3 * t)) + 0.01 * rng.standard_normal(t.size))
    mel = LogMelFrontEnd(num_mel_bins=16)([pcm.astype(np.float32)])  # raw PCM straight into the front end
    num_frames = int(mel.feature_lens[0])
    input_ids = torch.tensor([tiny_prompt_ids(num_user_text=3, num_audio_tokens=num_audio_tokens(num_frames))])
    ref_out = _hf_turn(
        ref, input_ids, input_features=mel.features, feature_attention_mask=mel.attention_mask,
        attention_mask=torch.ones_like(input_ids),
    )
    got = run_greedy_turn(
        ours, input_ids, MAX_NEW_TOKENS, MAX_FRAMES, input_features=mel.packed(), feature_lens=mel.feature_lens
    )
    _check(got, ref_out)


def test_weights_loaded_equal_reference(models: tuple[torch.nn.Module, TurnModels]) -> None:
    ref, ours = models
    ref_sd = ref.state_dict()
    for prefix, module in (("thinker.", ours.thinker), ("talker.", ours.talker), ("code2wav.", ours.code2wav)):
        for name, tensor in module.state_dict().items():
            assert torch.equal(tensor, ref_sd[prefix + name]), prefix + name
