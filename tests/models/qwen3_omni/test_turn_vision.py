"""A whole greedy turn with images / a video (thinker -> talker + MTP -> code2wav) vs transformers'
`generate(return_audio=True)`: the talker prefill takes `hidden_projection` of the thinker's hidden state at
the vision placeholders and their grid positions (the tiny vision config: 2 x 2 merge, two DeepStack layers).
The visual features come from transformers' own tower, so only the thinker and talker sides are compared.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import transformers
from omni_reference import hf_turn, randomize_
from thinker_vision_reference import PROMPTS, hf_tower, vision_config_dict, visual_inputs

from voice_server.models.qwen3_omni.talker.prefill import build_talker_prefill
from voice_server.models.qwen3_omni.turn import (
    TurnModels,
    load_turn_models,
    run_greedy_thinker,
    run_greedy_turn,
    talker_rope_layout,
    turn_token_ids,
)

torch.set_num_threads(1)
MAX_NEW_TOKENS = 6
MAX_FRAMES = 7


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> tuple[torch.nn.Module, TurnModels]:
    ckpt: Path = tmp_path_factory.mktemp("tiny_qwen3_omni_vision")
    ref = transformers.Qwen3OmniMoeForConditionalGeneration(transformers.Qwen3OmniMoeConfig(**vision_config_dict()))
    randomize_(ref.eval())
    ref.save_pretrained(ckpt)
    return ref, load_turn_models(ckpt)


@pytest.mark.parametrize("name", ["image", "two_images", "video"])
def test_vision_prompt_turn_matches_hf(models: tuple[torch.nn.Module, TurnModels], name: str) -> None:
    ref, ours = models
    ids = PROMPTS[name].input_ids
    media = PROMPTS[name].media(ours.cfg.thinker.vision.patch_dim, ours.cfg.thinker.audio.num_mel_bins)
    text_ids, codes, wav = hf_turn(ref, MAX_NEW_TOKENS, MAX_FRAMES, input_ids=ids, **media)
    visual = visual_inputs(hf_tower(ref.thinker), media)
    got = run_greedy_turn(ours, ids, MAX_NEW_TOKENS, MAX_FRAMES, visual=visual)
    assert torch.equal(got.text_ids, text_ids)
    assert torch.equal(got.codes, codes)
    assert got.waveform.shape == wav.shape and (got.waveform - wav).abs().max().item() <= 1e-4
    assert codes.shape[-1] > 0 and got.text_ids.shape[1] > ids.shape[1] + 1


def test_talker_prefill_gives_vision_placeholders_grid_positions(models: tuple[torch.nn.Module, TurnModels]) -> None:
    _, ours = models
    ids = PROMPTS["two_images"].input_ids
    media = PROMPTS["two_images"].media(ours.cfg.thinker.vision.patch_dim, ours.cfg.thinker.audio.num_mel_bins)
    visual = visual_inputs(hf_tower(models[0].thinker), media)
    turn = run_greedy_thinker(ours.thinker, ids, ours.cfg.talker.accept_hidden_layer, -1, 2, visual=visual)
    special = torch.tensor(turn_token_ids(ours.cfg).tts_special_ids)
    tts_embeds = ours.thinker.model.language_model.embed_tokens(special)
    args = (ours.talker, turn_token_ids(ours.cfg), turn.consumed_ids, ids.shape[1], turn.inputs_embeds,
            turn.accepted_hidden, tts_embeds, "ethan")
    prefill = build_talker_prefill(*args, visual, talker_rope_layout(ours.cfg))
    is_image = prefill.input_ids[0] == ours.cfg.thinker.image_token_id
    # Rows and columns of the merged grid: the h / w axes differ from t inside each image block.
    assert (prefill.positions[1, 0, is_image] != prefill.positions[0, 0, is_image]).any()
    assert int(prefill.positions.max()) < prefill.positions.shape[-1] - 1  # the grids shorten the span
    with pytest.raises(ValueError, match="needs their grids"):
        build_talker_prefill(*args)
