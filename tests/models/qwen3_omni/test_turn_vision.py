"""A whole greedy turn with images / a video (thinker -> talker + MTP -> code2wav) vs transformers'
`generate(return_audio=True)`: the talker prefill takes `hidden_projection` of the thinker's hidden state at
the vision placeholders and their grid positions (the tiny vision config: 2 x 2 merge, two DeepStack layers).
The visual features come from transformers' own tower, so only the thinker and talker sides are compared.

A video whose frame times are fractional (0.7 s per temporal patch x 13) gives the talker float32 positions,
prefill and decode: the decode positions continue one float32 + 1 at a time, as transformers' generate
appends them (`continue_positions`, checked here against transformers' own update far past where that and
`cache_len + rope_delta` part).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from omni_reference import hf_turn
from thinker_vision_reference import PROMPTS, hf_tower, save_vision_reference, visual_inputs
from transformers import GenerationMixin

from voice_server.models.qwen3_omni.talker.prefill import build_talker_prefill
from voice_server.models.qwen3_omni.thinker.rope import continue_positions
from voice_server.models.qwen3_omni.thinker.visual import VisualInputs
from voice_server.models.qwen3_omni.turn import (
    TurnModels,
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
    return save_vision_reference(ckpt)


@pytest.mark.parametrize("name", ["image", "two_images", "video", "video_fractional_time"])
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


def _prefill_args(
    models: tuple[torch.nn.Module, TurnModels], name: str
) -> tuple[tuple[Any, ...], VisualInputs, dict[str, Any]]:
    """`build_talker_prefill`'s arguments but the vision ones for prompt `name` after a 2-token reply, its
    `VisualInputs` and transformers' inputs."""
    ref, ours = models
    ids = PROMPTS[name].input_ids
    media = PROMPTS[name].media(ours.cfg.thinker.vision.patch_dim, ours.cfg.thinker.audio.num_mel_bins)
    visual = visual_inputs(hf_tower(ref.thinker), media)
    turn = run_greedy_thinker(ours.thinker, ids, ours.cfg.talker.accept_hidden_layer, -1, 2, visual=visual)
    special = torch.tensor(turn_token_ids(ours.cfg).tts_special_ids)
    tts_embeds = ours.thinker.model.language_model.embed_tokens(special)
    args = (ours.talker, turn_token_ids(ours.cfg), turn.consumed_ids, ids.shape[1], turn.inputs_embeds,
            turn.accepted_hidden, tts_embeds, "ethan")
    return args, visual, media


def test_talker_prefill_gives_vision_placeholders_grid_positions(models: tuple[torch.nn.Module, TurnModels]) -> None:
    ours = models[1]
    args, visual, _ = _prefill_args(models, "two_images")
    prefill = build_talker_prefill(*args, visual, talker_rope_layout(ours.cfg))
    is_image = prefill.input_ids[0] == ours.cfg.thinker.image_token_id
    # Rows and columns of the merged grid: the h / w axes differ from t inside each image block.
    assert (prefill.positions[1, 0, is_image] != prefill.positions[0, 0, is_image]).any()
    assert int(prefill.positions.max()) < prefill.positions.shape[-1] - 1  # the grids shorten the span
    with pytest.raises(ValueError, match="needs their grids"):
        build_talker_prefill(*args)


def test_talker_prefill_of_a_fractional_time_video_has_transformers_float32_positions(
    models: tuple[torch.nn.Module, TurnModels],
) -> None:
    ref, ours = models
    args, visual, media = _prefill_args(models, "video_fractional_time")
    prefill = build_talker_prefill(*args, visual, talker_rope_layout(ours.cfg))
    expected, _ = ref.talker.get_rope_index(
        prefill.input_ids, video_grid_thw=media["video_grid_thw"], attention_mask=torch.ones_like(prefill.input_ids),
        second_per_grids=media["video_second_per_grid"],
    )
    assert prefill.positions.dtype == torch.float32 and torch.equal(prefill.positions, expected)
    assert not torch.equal(prefill.positions, prefill.positions.round())


def _frame_time(second_per_grid: float, frame: int) -> torch.Tensor:
    """The t position of a video's temporal patch `frame` at `second_per_grid` (x 13), as `get_rope_index` has it."""
    return (torch.arange(frame + 1) * torch.tensor(second_per_grid) * 13).float()[frame]


def test_decode_positions_continue_as_transformers_generate_appends_them() -> None:
    # NOTE: 301 frames at 30 fps sampled at 2 fps keep 20, 2 a temporal patch: 301 / 300 s per patch. A talker
    # prompt ending 3 rows after its second patch starts at 16.04333..; one of 0.7 s a patch, 8 after its third.
    num, prompt_len = 3000, 6000
    cases = {  # last prefill position: whether (last + k, cache_len + rope_delta) equal transformers' positions
        "301 frames at 30 fps": (_frame_time(301 / 300, 1) + 3, (False, False)),
        "0.7 s a patch": (_frame_time(0.7, 2) + 8, (True, False)),
        "whole": (torch.tensor(17.0), (True, True)),
    }
    for name, (last, is_equal_at_once) in cases.items():
        kwargs = {"position_ids": last.expand(4, 1, 1)}
        for _ in range(num):
            kwargs = GenerationMixin._update_model_kwargs_for_generation(None, {}, kwargs)  # type: ignore[arg-type]
        expected = kwargs["position_ids"][1, 0, 1:]
        is_whole = name == "whole"
        got = continue_positions(last.long() if is_whole else last, num)
        assert got.dtype == (torch.int64 if is_whole else torch.float32) and torch.equal(got.float(), expected)
        # NOTE: one float32 rounding instead of one per step (from the last position, or from a long prompt's rope
        # delta, itself rounded) lands an ulp away for many rows.
        delta = last + 1 - prompt_len
        at_once = (last + torch.arange(1, num + 1), torch.arange(prompt_len, prompt_len + num) + delta)
        assert tuple(torch.equal(t, expected) for t in at_once) == is_equal_at_once, name
