"""Image and video prompts through the streaming Qwen3-Omni pipeline (thinker -> talker -> code2wav, one process
each) against transformers' `generate(return_audio=True)` on the same weights (where transformers cannot speak the
prompt, audio with images or video, its thinker's text and `run_greedy_turn`'s codes: `omni_vision_turns.py`): the
tiny vision config of `thinker_vision_reference` (2 x 2 merge, two DeepStack layers), written with `save_pretrained`.

Each payload is what the encoder stage sends the thinker (`voice_server/runners/encoder_runner.py`): `token_ids`
with the blocks expanded, `visual_embeds` / `visual_deepstack` from transformers' own vision tower (so only the
thinker and talker sides are compared), the grids, and `audio_embeds` for audio. Per request: the thinker's text
ids and the talker's codes equal the reference's, the waveform within 1e-4, for images, two images, a video,
a video whose frame times are fractional (float32 positions in the thinker and the talker, whose steps holding
it run on the exact path, not the graphs' buffers), a video and an image, audio with an image or a video, audio
alone and text alone, staggered and batched together; and alone, with a prefill chunk cutting an image block and
with a prefix-cache hit on a shared text prefix before an image. The talker's prefills come in chunks too, and its
decode steps run on the fixed-shape buffers its CUDA graphs replay (eagerly here), at the vision prompts' shifted
positions.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from harness import Pipeline, shm_segments
from omni_vision_turns import Limits, check_streamed, params_of, reference_turn, submit_all
from thinker_vision_reference import (
    IDS,
    IMAGE_GRID,
    PROMPTS,
    WIDE_GRID,
    Prompt,
    audio_block,
    audio_inputs,
    chat,
    hf_tower,
    image_block,
    save_vision_reference,
    visual_inputs,
)

from voice_server.config import pipeline_from_dict
from voice_server.models.qwen3_omni.thinker.visual import visual_deepstack
from voice_server.models.qwen3_omni.turn import TurnModels

torch.set_num_threads(1)
MAX_STEP_TOKENS = 16
"""Small, so the thinker's and the talker's prefills come in chunks: alone, a prompt's end at 16, 32, .."""


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> tuple[torch.nn.Module, TurnModels, Path]:
    ckpt: Path = tmp_path_factory.mktemp("tiny_qwen3_omni_vision")
    return (*save_vision_reference(ckpt), ckpt)


@pytest.fixture(scope="module")
def omni(reference: tuple[torch.nn.Module, TurnModels, Path]) -> Iterator[Pipeline]:
    common = {"checkpoint": str(reference[2]), "num_threads": 1}
    pipeline = Pipeline(pipeline_from_dict({
        "name": "omni-vision",
        "stages": [
            {"name": "thinker", "factory": "voice_server.stages.thinker:create_thinker", "scheduler": "ar",
             "terminal": True, "stream_to": ["talker"], "max_batch_size": 8, "max_step_tokens": MAX_STEP_TOKENS,
             "factory_args": common},
            # NOTE: terminal here so the test sees the codes; a deployment streams only text and audio.
            {"name": "talker", "factory": "voice_server.stages.talker:create_talker", "scheduler": "ar",
             "terminal": True, "stream_to": ["code2wav"], "max_batch_size": 8, "max_step_tokens": MAX_STEP_TOKENS,
             "factory_args": {**common, "cuda_graphs": "on", "graph_max_len": 48}},
            {"name": "code2wav", "factory": "voice_server.stages.code2wav:create_code2wav", "scheduler": "code2wav",
             "terminal": True, "max_batch_size": 8, "factory_args": common},
        ],
    }))
    yield pipeline
    pipeline.close()
    assert shm_segments(pipeline.coordinator.launch_id) == []


def media_of(ours: TurnModels, prompt: Prompt) -> dict[str, Any]:
    return prompt.media(ours.cfg.thinker.vision.patch_dim, ours.cfg.thinker.audio.num_mel_bins)


def thinker_payload(ref: torch.nn.Module, ours: TurnModels, prompt: Prompt) -> dict[str, Any]:
    """What the encoder stage would send the thinker for this prompt."""
    cfg = ours.cfg.thinker
    media = media_of(ours, prompt)
    ids = prompt.input_ids[0]
    payload: dict[str, Any] = {"token_ids": ids.tolist()}
    if prompt.image_grids or prompt.video_grids:
        visual = visual_inputs(hf_tower(ref.thinker), media)
        # NOTE: the encoder's layout: every image's and video's rows in the order their placeholders appear.
        is_image, is_video = ids == cfg.image_token_id, ids == cfg.video_token_id
        is_visual = is_image | is_video
        embeds = torch.zeros(int(is_visual.sum()), cfg.text.hidden_size)
        for is_kind, rows in ((is_image, visual.image_embeds), (is_video, visual.video_embeds)):
            if rows is not None:
                embeds[is_kind[is_visual]] = rows
        deepstack = visual_deepstack(ids, cfg.image_token_id, cfg.video_token_id, visual)
        assert deepstack is not None
        payload.update(visual_embeds=embeds, visual_deepstack=deepstack.embeds,
                       image_grid_thw=[list(g) for g in prompt.image_grids],
                       video_grid_thw=[list(g) for g in prompt.video_grids],
                       video_second_per_grid=list(prompt.second_per_grid))
    audio, _ = audio_inputs(ours.thinker, media)
    if audio is not None:
        payload["audio_embeds"] = audio
    return payload


SYSTEM = [IDS["im_start"], IDS["system"], 10, *range(50, 68), IDS["im_end"], 10]
"""A system turn of 24 tokens: with it, a prompt's first image placeholder is past the first 16-token page."""

CASES: dict[str, tuple[Prompt, Limits]] = {
    # name: (prompt, (reply tokens, frames) at most); some replies shorter than their audio, some longer.
    "image": (PROMPTS["image"], (6, 9)),
    "two_images": (PROMPTS["two_images"], (9, 6)),
    "video": (PROMPTS["video"], (5, 11)),
    "video_fractional_time": (PROMPTS["video_fractional_time"], (7, 14)),
    "image_video": (PROMPTS["image_video"], (7, 7)),
    "audio_video": (PROMPTS["audio_video"], (8, 5)),
    "audio_image": (Prompt(torch.tensor([chat(audio_block(230), image_block(WIDE_GRID))]), image_grids=[WIDE_GRID],
                           audio_frames=[230], seed=7), (6, 8)),
    "audio": (Prompt(torch.tensor([chat(audio_block(180))]), audio_frames=[180], seed=8), (7, 6)),
    "text": (Prompt(torch.tensor([chat([40, 41, 42, 43])])), (5, 10)),
}


def check(ref: torch.nn.Module, ours: TurnModels, prompt: Prompt, limits: Limits, got: list[Any]) -> str:
    media = media_of(ours, prompt)
    visual = visual_inputs(hf_tower(ref.thinker), media) if prompt.image_grids or prompt.video_grids else None
    return check_streamed(ours, prompt.input_ids, reference_turn(ref, ours, prompt.input_ids, media, visual, limits),
                          got)


def test_staggered_vision_audio_and_text_requests_stream_what_the_reference_generates(
    omni: Pipeline, reference: tuple[torch.nn.Module, TurnModels, Path]
) -> None:
    ref, ours, _ = reference
    payloads = [thinker_payload(ref, ours, prompt) for prompt, _ in CASES.values()]
    outputs = submit_all(omni, payloads, [limits for _, limits in CASES.values()], stagger_s=0.05)
    for (name, (prompt, limits)), got in zip(CASES.items(), outputs, strict=True):
        assert not isinstance(got, BaseException), (name, got)
        print(f"{name}: {check(ref, ours, prompt, limits, got)}")


def counters(omni: Pipeline, stage: str) -> dict[str, int]:
    return omni.run(omni.coordinator.stats())[stage].counters[stage]


def test_a_chunk_cutting_an_image_block_and_a_prefix_cache_hit_before_an_image_change_nothing(
    omni: Pipeline, reference: tuple[torch.nn.Module, TurnModels, Path]
) -> None:
    ref, ours, _ = reference
    # One at a time, so each prefill runs in chunks of MAX_STEP_TOKENS: [16, 32) ends inside the first image
    # block of each (placeholders 29..34, then 31..33), and the second request hits the first's page of the
    # shared system turn, [0, 16) (the first's first placeholder, at 29, bounds what the cache may hold).
    shared = Prompt(torch.tensor([SYSTEM + chat(image_block(IMAGE_GRID))]), image_grids=[IMAGE_GRID], seed=9)
    other = Prompt(torch.tensor([SYSTEM + chat([44], image_block(WIDE_GRID), image_block(IMAGE_GRID))]),
                   image_grids=[WIDE_GRID, IMAGE_GRID], seed=10)
    first_placeholder = (shared.input_ids[0] == IDS["image"]).nonzero()[0].item()
    assert first_placeholder > MAX_STEP_TOKENS and first_placeholder % MAX_STEP_TOKENS != 0
    for prompt, limits in ((shared, (6, 7)), (other, (7, 6))):
        before = counters(omni, "thinker")["num_prefix_hit_tokens"]
        got = omni.collect(thinker_payload(ref, ours, prompt), params_of(limits))
        hits = counters(omni, "thinker")["num_prefix_hit_tokens"] - before
        print(f"{check(ref, ours, prompt, limits, got)}, {hits} prefix-cache hit tokens")
        assert hits == (16 if prompt is other else 0)
