"""Thinker with images and videos vs transformers' Qwen3OmniMoeThinkerForConditionalGeneration (tiny, fp32).

The visual embeddings and DeepStack features come from transformers' own vision tower (`model.visual`), so
these tests check the decoder side alone: placeholder scatter, M-RoPE positions (images, videos with whole
and fractional frame times, audio, audio inside a video) and DeepStack injection; then the same with our
`VisionEncoder` in place of transformers' tower.
"""

from __future__ import annotations

import pytest
import torch
from thinker_vision_reference import (
    IDS,
    IMAGE_GRID,
    PROMPTS,
    VIDEO_GRID,
    audio_inputs,
    chat,
    hf_tower,
    image_block,
    thinker_pair,
    video_block,
    visual_inputs,
)

from voice_server.models.qwen3_omni.thinker.model import ThinkerModel
from voice_server.models.qwen3_omni.thinker.rope import get_rope_index
from voice_server.models.qwen3_omni.thinker.visual import VisualInputs
from voice_server.models.qwen3_omni.vision.encoder import VisionEncoder

torch.set_num_threads(1)
ATOL = 1e-5


@pytest.fixture(scope="module")
def pair() -> tuple[ThinkerModel, torch.nn.Module]:
    return thinker_pair()


def _max_err(a: torch.Tensor, b: torch.Tensor) -> float:
    assert a.shape == b.shape, (a.shape, b.shape)
    return (a - b).abs().max().item()


def _media(ours: ThinkerModel, name: str) -> dict:
    return PROMPTS[name].media(ours.cfg.vision.patch_dim, ours.cfg.audio.num_mel_bins)


def _hf_rope_index(ref: torch.nn.Module, ids: torch.Tensor, media: dict) -> tuple[torch.Tensor, torch.Tensor]:
    feature_mask = media.get("feature_attention_mask")
    return ref.get_rope_index(
        ids, media.get("image_grid_thw"), media.get("video_grid_thw"), media["attention_mask"],
        media.get("use_audio_in_video", False), None if feature_mask is None else feature_mask.sum(-1),
        media.get("video_second_per_grid"),
    )


def _assert_same_positions(got: tuple[torch.Tensor, torch.Tensor], expected: tuple[torch.Tensor, torch.Tensor]) -> None:
    """(positions, deltas): the reference's are float32; ours int64 when every position is whole, else
    float32 (deltas follow the positions' dtype), and equal either way."""
    (positions, deltas), (expected_positions, expected_deltas) = got, expected
    is_whole = torch.equal(expected_positions, expected_positions.round())
    assert positions.dtype == deltas.dtype == (torch.int64 if is_whole else torch.float32)
    assert torch.equal(positions.float(), expected_positions)  # NOTE: whole positions are exact in float32
    assert torch.equal(deltas.float(), expected_deltas)


@pytest.mark.parametrize("name", list(PROMPTS))
def test_rope_index_matches_hf(pair: tuple[ThinkerModel, torch.nn.Module], name: str) -> None:
    ours, ref = pair
    prompt, media = PROMPTS[name], _media(ours, name)
    feature_mask = media.get("feature_attention_mask")
    got = get_rope_index(
        prompt.input_ids, ours.cfg, media["attention_mask"], None if feature_mask is None else feature_mask.sum(-1),
        image_grid_thw=media.get("image_grid_thw"), video_grid_thw=media.get("video_grid_thw"),
        video_second_per_grid=media.get("video_second_per_grid"),
    )
    _assert_same_positions(got, _hf_rope_index(ref, prompt.input_ids, media))
    positions = got[0]
    assert (positions[1] != positions[0]).any() or (positions[2] != positions[0]).any()  # vision rows are 3-D


def test_rope_index_of_a_left_padded_batch_matches_hf(pair: tuple[ThinkerModel, torch.nn.Module]) -> None:
    ours, ref = pair
    rows = [chat(image_block(IMAGE_GRID)), chat(image_block((1, 2, 2)), video_block(VIDEO_GRID)), chat([40])]
    width = max(map(len, rows))
    ids = torch.tensor([[0] * (width - len(r)) + r for r in rows])
    mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows])
    grids = {"image_grid_thw": torch.tensor([IMAGE_GRID, (1, 2, 2)]), "video_grid_thw": torch.tensor([VIDEO_GRID])}
    for second_per_grid in (1.0, 0.7):
        spg = torch.tensor([second_per_grid])
        _assert_same_positions(
            get_rope_index(ids, ours.cfg, mask, video_second_per_grid=spg, **grids),
            ref.get_rope_index(ids, attention_mask=mask, second_per_grids=spg, **grids),
        )


@pytest.mark.parametrize("name", list(PROMPTS))
@torch.no_grad()
def test_logits_and_hidden_states_match_hf(pair: tuple[ThinkerModel, torch.nn.Module], name: str) -> None:
    ours, ref = pair
    ids, media = PROMPTS[name].input_ids, _media(ours, name)
    expected = ref(input_ids=ids, output_hidden_states=True, **media)
    visual = visual_inputs(hf_tower(ref), media)
    audio, feature_lens = audio_inputs(ours, media)
    positions, _ = get_rope_index(ids, ours.cfg, media["attention_mask"], feature_lens, **visual.rope_grids())
    for layer in (1, 2, 3):  # after DeepStack layer 0, layer 1, and past them (post-norm)
        got = ours(ids, positions, audio_embeds=audio, accept_hidden_layer=layer, visual=visual)
        assert got.accepted_hidden is not None
        assert _max_err(got.accepted_hidden, expected.hidden_states[layer]) <= ATOL, layer
    assert _max_err(got.inputs_embeds, expected.hidden_states[0]) <= ATOL
    assert _max_err(got.logits, expected.logits) <= ATOL
    assert expected.logits.abs().max() > 0.1
    # DeepStack moves the logits: the comparison above would catch it missing.
    plain = VisualInputs(image_embeds=visual.image_embeds, video_embeds=visual.video_embeds)
    assert _max_err(ours(ids, positions, audio_embeds=audio, visual=plain).logits, expected.logits) > 1e-2


@torch.no_grad()
def test_our_vision_encoder_gives_the_same_logits(pair: tuple[ThinkerModel, torch.nn.Module]) -> None:
    ours, ref = pair
    tower = VisionEncoder(ours.cfg.vision).eval()
    tower.load_state_dict(ref.model.visual.state_dict())
    for name in ("image_video", "two_images"):
        ids, media = PROMPTS[name].input_ids, _media(ours, name)
        visual = visual_inputs(tower, media)
        positions, _ = get_rope_index(ids, ours.cfg, **visual.rope_grids())
        assert _max_err(ours(ids, positions, visual=visual).logits, ref(input_ids=ids, **media).logits) <= ATOL


def test_embed_rejects_a_feature_count_mismatch(pair: tuple[ThinkerModel, torch.nn.Module]) -> None:
    ours, _ = pair
    ids = PROMPTS["image"].input_ids
    num_tokens = int((ids == IDS["image"]).sum())
    short = VisualInputs(image_embeds=torch.zeros(num_tokens - 1, ours.cfg.text.hidden_size))
    with pytest.raises(ValueError, match=f"{num_tokens} image placeholder tokens but {num_tokens - 1} image emb"):
        ours.embed(ids, visual=short)
    with pytest.raises(ValueError, match=f"{num_tokens} image placeholder tokens but 0 image embeddings"):
        ours.embed(ids)
    ds = VisualInputs(image_deepstack=(torch.zeros(num_tokens + 1, ours.cfg.text.hidden_size),))
    with pytest.raises(ValueError, match="DeepStack rows"):
        ours.deepstack(ids, ds)


def test_rope_index_rejects_mismatched_grids(pair: tuple[ThinkerModel, torch.nn.Module]) -> None:
    ours, _ = pair
    ids = PROMPTS["image"].input_ids
    with pytest.raises(ValueError, match=r"image 0 has 6 placeholder tokens, its grid \(1, 4, 4\) needs 4"):
        get_rope_index(ids, ours.cfg, image_grid_thw=torch.tensor([[1, 4, 4]]))
    with pytest.raises(ValueError, match="2 image grids were given"):
        get_rope_index(ids, ours.cfg, image_grid_thw=torch.tensor([IMAGE_GRID, IMAGE_GRID]))
    with pytest.raises(ValueError, match="video_second_per_grid"):
        get_rope_index(PROMPTS["video"].input_ids, ours.cfg, video_grid_thw=torch.tensor([VIDEO_GRID]))
    stray = torch.tensor([chat([IDS["image"]])])
    with pytest.raises(ValueError, match="outside their blocks"):
        get_rope_index(stray, ours.cfg, image_grid_thw=torch.zeros(0, 3, dtype=torch.long))
