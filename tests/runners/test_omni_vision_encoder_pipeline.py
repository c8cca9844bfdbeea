"""Images, video and audio from the client's request through all four Qwen3-Omni stages (encoder with `vision: true`
-> thinker -> talker -> code2wav, one process each) against transformers' `generate(return_audio=True)` fed the
processors' inputs of the same images, video and clips (where transformers cannot speak the prompt, audio with an
image, its thinker's text and `run_greedy_turn`'s codes: `omni_vision_turns.py`), on the tiny vision config of
`thinker_vision_reference` written with `save_pretrained`.

Eight staggered requests as `messages` (the tiny preset's stand-in chat template) or `token_ids` with one
placeholder per block: an image, two images, a video, an image with audio, an image after a system turn, audio
alone and text alone. Each gives the reference's text ids and codes, and its waveform within 1e-4. The reference's
inputs come from the encoder stage's own admission run in-process (the expanded ids, the processors' patches, the
clips): the encoder's preprocessing equals transformers' processors (tests/models/qwen3_omni/test_vision_preprocess.py).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from harness import Pipeline, shm_segments
from image_inputs import pixels, png
from omni_vision_turns import Limits, check_streamed, reference_turn, submit_all
from thinker_vision_reference import IDS, chat, save_vision_reference

from voice_server.config import pipeline_from_dict
from voice_server.models.qwen3_omni.audio.encoder import AudioEncoder
from voice_server.models.qwen3_omni.audio.mel import LogMelFrontEnd
from voice_server.models.qwen3_omni.chat import chat_inputs, tiny_encode
from voice_server.models.qwen3_omni.loading import load_part
from voice_server.models.qwen3_omni.presets import tiny_prompt_ids
from voice_server.models.qwen3_omni.thinker.visual import VisualInputs
from voice_server.models.qwen3_omni.turn import TurnModels
from voice_server.models.qwen3_omni.vision.encoder import VisionEncoder
from voice_server.runners.encoder_runner import AudioEncoderRunner, AudioEncoderRunnerConfig
from voice_server.runners.vision_input import AdmittedVision, VisionInputConfig
from voice_server.scheduling import SimpleBatch, WorkItem, WorkKind

torch.set_num_threads(1)
BUDGET_MB = 64
IMAGE = [IDS["vision_start"], IDS["image"], IDS["vision_end"]]


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> tuple[torch.nn.Module, TurnModels, Path]:
    ckpt: Path = tmp_path_factory.mktemp("tiny_qwen3_omni_vision_encoder")
    return (*save_vision_reference(ckpt, seed=1), ckpt)


@pytest.fixture(scope="module")
def omni(reference: tuple[torch.nn.Module, TurnModels, Path]) -> Iterator[Pipeline]:
    common = {"checkpoint": str(reference[2]), "num_threads": 1}
    pipeline = Pipeline(pipeline_from_dict({
        "name": "omni-vision-encoder",
        "stages": [
            {"name": "encoder", "factory": "voice_server.stages.audio_encoder:create_audio_encoder", "next": "thinker",
             "max_batch_size": 4, "factory_args": {**common, "vision": True, "activation_budget_mb": BUDGET_MB}},
            {"name": "thinker", "factory": "voice_server.stages.thinker:create_thinker", "scheduler": "ar",
             "terminal": True, "stream_to": ["talker"], "max_batch_size": 8, "max_step_tokens": 64,
             "factory_args": common},
            # NOTE: terminal here so the test sees the codes; a deployment streams only text and audio.
            {"name": "talker", "factory": "voice_server.stages.talker:create_talker", "scheduler": "ar",
             "terminal": True, "stream_to": ["code2wav"], "max_batch_size": 8, "max_step_tokens": 64,
             "factory_args": common},
            {"name": "code2wav", "factory": "voice_server.stages.code2wav:create_code2wav", "scheduler": "code2wav",
             "terminal": True, "max_batch_size": 8, "factory_args": common},
        ],
    }))
    yield pipeline
    pipeline.close()
    assert shm_segments(pipeline.coordinator.launch_id) == []


def encoder_runner(ours: TurnModels, ckpt: Path) -> AudioEncoderRunner:
    """The encoder stage's runner, in-process, on the same checkpoint (what the reference's inputs come from)."""
    cfg = ours.cfg
    audio, vision = (load_part(part, cfg, ckpt) for part in ("audio_tower", "vision"))
    assert isinstance(audio, AudioEncoder) and isinstance(vision, VisionEncoder)
    return AudioEncoderRunner(audio, AudioEncoderRunnerConfig.from_thinker(cfg.thinker),
                              lambda messages: chat_inputs(messages, cfg, tiny_encode), vision,
                              VisionInputConfig.from_thinker(cfg.thinker, 4, BUDGET_MB << 20))


def reference_inputs(runner: AudioEncoderRunner, ours: TurnModels, payload: dict[str, Any]
                     ) -> tuple[torch.Tensor, dict[str, Any], VisualInputs | None]:
    """(input_ids [1, L], transformers' media, the thinker's visual rows) of a client payload, as the encoder
    stage admits and encodes it."""
    admitted = runner.admit(WorkItem("r", WorkKind.NEW, payload, {})).payload
    input_ids = torch.tensor([admitted["token_ids"]])
    media: dict[str, Any] = {"attention_mask": torch.ones_like(input_ids)}
    if (audio := admitted.get("audio")) is not None:
        mel = LogMelFrontEnd(num_mel_bins=ours.cfg.thinker.audio.num_mel_bins)([c.numpy() for c in audio.clips])
        media.update(input_features=mel.features, feature_attention_mask=mel.attention_mask)
    vision = admitted.get("vision")
    if not isinstance(vision, AdmittedVision):
        return input_ids, media, None
    for is_video, pixels_key, grid_key in ((False, "pixel_values", "image_grid_thw"),
                                           (True, "pixel_values_videos", "video_grid_thw")):
        items = [(p, g) for p, g, v in zip(vision.pixel_values, vision.grids, vision.is_video) if v == is_video]
        if items:
            media[pixels_key] = torch.from_numpy(np.concatenate([p for p, _ in items]))
            media[grid_key] = torch.tensor([g for _, g in items])
    if any(vision.is_video):
        media["video_second_per_grid"] = torch.tensor(vision.video_second_per_grid)
    result = runner.execute(SimpleBatch((WorkItem("r", WorkKind.NEW, admitted, {}),))).emits[0].payload
    return input_ids, media, split_visual(input_ids[0], result, ours)


def split_visual(ids: torch.Tensor, result: dict[str, Any], ours: TurnModels) -> VisualInputs:
    """The encoder's rows (in placeholder order) as `VisualInputs` (each kind's rows apart)."""
    th = ours.cfg.thinker
    is_image, is_video = ids == th.image_token_id, ids == th.video_token_id
    kinds = is_image[is_image | is_video]
    embeds, deepstack = result["visual_embeds"], result["visual_deepstack"]
    images, videos = result["image_grid_thw"], result["video_grid_thw"]
    return VisualInputs(
        image_embeds=embeds[kinds], image_deepstack=tuple(deepstack[:, kinds]),
        image_grid_thw=torch.tensor(images) if images else None,
        video_embeds=embeds[~kinds], video_deepstack=tuple(deepstack[:, ~kinds]),
        video_grid_thw=torch.tensor(videos) if videos else None,
        video_second_per_grid=torch.tensor(result["video_second_per_grid"]) if videos else None,
    )


def pcm(num_samples: int, seed: int) -> np.ndarray:
    t = np.arange(num_samples) / 16000
    wave = 0.3 * np.sin(2 * np.pi * (200 + 30 * seed) * t) * (1 + np.sin(2 * np.pi * 3 * t))
    return (wave + 0.01 * np.random.default_rng(seed).standard_normal(t.size)).astype(np.float32)


def user(content: str, **media: Any) -> list[dict[str, Any]]:
    return [{"role": "user", "content": content, **media}]


CASES: dict[str, tuple[dict[str, Any], Limits]] = {
    # name: (the client's payload, (reply tokens, frames) at most)
    "image": ({"messages": user("What is it?", images=[png(pixels((64, 96, 3), 1))])}, (6, 9)),
    "image_ids": ({"token_ids": chat(IMAGE), "images": [pixels((96, 64, 3), 2)]}, (9, 6)),
    "two_images": ({"messages": user("Which?", images=[png(pixels((40, 56, 3), 3)), pixels((64, 64, 3), 4)])},
                   (5, 11)),
    # NOTE: 4 frames at 2 fps: two temporal patches of 1 s each (whole M-RoPE times; the talker takes no other).
    "video": ({"messages": user("And this?", videos=[{"frames": pixels((4, 48, 40, 3), 5), "fps": 2.0}])}, (7, 7)),
    "audio_image": ({"messages": user("Hm", audio=pcm(24_000, 6), images=[png(pixels((64, 64, 3), 6))])}, (8, 5)),
    "system_image": ({"messages": [{"role": "system", "content": "Be brief."},
                                   *user("Look", images=[pixels((32, 96, 3), 7)])]}, (6, 8)),
    "audio_ids": ({"token_ids": tiny_prompt_ids(num_user_text=3, num_audio_tokens=1), "audio": [pcm(20_000, 8)]},
                  (7, 6)),
    "text_ids": ({"token_ids": tiny_prompt_ids(num_user_text=5)}, (5, 10)),
}


def test_eight_staggered_requests_with_images_video_and_audio_stream_what_the_reference_generates(
    omni: Pipeline, reference: tuple[torch.nn.Module, TurnModels, Path]
) -> None:
    ref, ours, ckpt = reference
    outputs = submit_all(omni, [p for p, _ in CASES.values()], [limits for _, limits in CASES.values()],
                         stagger_s=0.05)
    runner = encoder_runner(ours, ckpt)
    for (name, (payload, limits)), got in zip(CASES.items(), outputs, strict=True):
        assert not isinstance(got, BaseException), (name, got)
        input_ids, media, visual = reference_inputs(runner, ours, payload)
        expected = reference_turn(ref, ours, input_ids, media, visual, limits)
        print(f"{name}: {check_streamed(ours, input_ids, expected, got)}")
