"""The encoder stage's images and videos (`voice_server/runners/vision_input.py` through `AudioEncoderRunner`)
on the tiny preset: the RESULT payload equals the vision tower run on the processors' output, in prompt order;
messages give the same as token ids; a video chunked to fit the activation budget equals it unchunked; an
item that cannot fit is refused at admission and the rest of its batch completes; malformed input is refused
naming the field; a stage built without vision refuses images."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch
from image_inputs import pixels, png

from voice_server.models.qwen3_omni.audio.encoder import AudioEncoder
from voice_server.models.qwen3_omni.chat import tiny_encode
from voice_server.models.qwen3_omni.config import Qwen3OmniConfig
from voice_server.models.qwen3_omni.loading import load_part
from voice_server.models.qwen3_omni.presets import TINY_IDS, tiny_config_dict, tiny_prompt_ids
from voice_server.models.qwen3_omni.vision.encoder import VisionEncoder
from voice_server.models.qwen3_omni.vision.preprocess import preprocess_image
from voice_server.models.qwen3_omni.vision.video import preprocess_video
from voice_server.runners.encoder_runner import AudioEncoderRunner, AudioEncoderRunnerConfig
from voice_server.runners.vision_input import RESULT_KEYS, VisionInputConfig, forward_inputs
from voice_server.runners.vision_plan import peak_activation_bytes
from voice_server.scheduling import AdmissionError, SimpleBatch, WorkItem, WorkKind
from voice_server.stages.audio_encoder import _chat

torch.set_num_threads(1)
CFG = Qwen3OmniConfig.from_hf_dict(tiny_config_dict())
IMAGE = [TINY_IDS["vision_start"], TINY_IDS["image"], TINY_IDS["vision_end"]]
VIDEO = [TINY_IDS["vision_start"], TINY_IDS["video"], TINY_IDS["vision_end"]]
AUDIO = [TINY_IDS["audio_start"], TINY_IDS["audio"], TINY_IDS["audio_end"]]


@pytest.fixture(scope="module")
def towers() -> tuple[AudioEncoder, VisionEncoder]:
    audio, vision = (load_part(part, CFG, load_format="dummy", seed=0) for part in ("audio_tower", "vision"))
    assert isinstance(audio, AudioEncoder) and isinstance(vision, VisionEncoder)
    return audio, vision


def make_runner(towers: tuple[AudioEncoder, VisionEncoder], budget_bytes: int | None = 2**30) -> AudioEncoderRunner:
    vision = None if budget_bytes is None else VisionInputConfig.from_thinker(CFG.thinker, 4, budget_bytes)
    return AudioEncoderRunner(towers[0], AudioEncoderRunnerConfig.from_thinker(CFG.thinker, 5),
                              lambda messages: _chat(messages, CFG, tiny_encode),
                              towers[1] if vision else None, vision)


def video(num_frames: int, seed: int, fps: float = 2.0) -> dict[str, Any]:
    # NOTE: 16 frames at 2 fps: 8 s, sampled at 2 fps: 8 temporal patches; each frame is resized up to the
    # video processor's smallest (128 x 32 x 32 pixels): 400 x 336, 25 x 21 tiny patches.
    return {"frames": pixels((num_frames, 48, 40, 3), seed), "fps": fps}


FRAME = 25 * 21


def prompt(*blocks: list[int]) -> list[int]:
    base = tiny_prompt_ids(num_user_text=3)
    return base[:3] + [t for b in blocks for t in b] + base[3:]


def run(runner: AudioEncoderRunner, *payloads: dict[str, Any]) -> list[dict[str, Any]]:
    items = tuple(runner.admit(WorkItem(f"r{i}", WorkKind.NEW, p)) for i, p in enumerate(payloads))
    return [e.payload for e in runner.execute(SimpleBatch(items)).emits]


@torch.inference_mode()
def test_the_result_is_the_towers_output_in_prompt_order(towers: tuple[AudioEncoder, VisionEncoder]) -> None:
    runner = make_runner(towers)
    photo, clip = pixels((40, 56, 3), 1), video(16, 2)
    payload = {"token_ids": prompt(IMAGE, VIDEO, AUDIO, IMAGE), "images": [png(photo), pixels((30, 20), 3)],
               "videos": [clip], "audio": [np.zeros(16000, np.float32)], "note": 1}
    out = run(runner, payload)[0]
    # NOTE: the processors at the tower's patch sizes (the tiny tower merges 1 x 1: sides of 16 pixels)
    assert runner.vision_config is not None
    config = runner.vision_config.preprocess
    image_a, image_b = preprocess_image(png(photo), config), preprocess_image(pixels((30, 20), 3), config)
    clip_patches = preprocess_video(clip["frames"], 2.0, config)
    order = [image_a, clip_patches, image_b]  # NOTE: prompt order: the video's block is the second
    grids = [p.grid_thw for p in order]
    want = towers[1](torch.from_numpy(np.concatenate([p.pixel_values for p in order])), torch.tensor(grids))
    assert torch.equal(out["visual_embeds"], want.embeds)
    assert torch.equal(out["visual_deepstack"], torch.stack(want.deepstack))
    assert out["image_grid_thw"] == [list(image_a.grid_thw), list(image_b.grid_thw)]
    assert out["video_grid_thw"] == [list(clip_patches.grid_thw)] and clip_patches.grid_thw[0] == 8
    assert out["video_second_per_grid"] == [1.0]
    counts = [t * h * w for t, h, w in grids]  # NOTE: the tiny tower merges 1 x 1
    ids = out["token_ids"]
    assert [ids.count(TINY_IDS["image"]), ids.count(TINY_IDS["video"])] == [counts[0] + counts[2], counts[1]]
    assert len(ids) == len(payload["token_ids"]) - 4 + sum(counts) + out["audio_token_counts"][0]
    assert set(out) == {"token_ids", "note", "audio_embeds", "audio_token_counts", *RESULT_KEYS}
    # Exact counts are accepted as given; empty lists are dropped.
    again = run(runner, {**payload, "token_ids": ids, "images": payload["images"], "audio": payload["audio"]})[0]
    assert again["token_ids"] == ids and torch.equal(again["visual_embeds"], out["visual_embeds"])
    plain = {"token_ids": prompt(), "images": [], "videos": []}
    assert run(runner, plain) == [{"token_ids": prompt()}]
    text_only = {"token_ids": prompt(AUDIO[:1] + AUDIO[2:])[:3] + prompt()[3:]}
    assert run(runner, text_only)[0] is text_only


@torch.inference_mode()
def test_messages_give_what_token_ids_give(towers: tuple[AudioEncoder, VisionEncoder]) -> None:
    runner = make_runner(towers)
    images, videos = [pixels((33, 47, 3), 4)], [video(10, 5, fps=5.0)]
    messages = [{"role": "system", "content": "look"},
                {"role": "user", "content": "what is it", "images": images, "videos": videos}]
    via_messages = run(runner, {"messages": messages})[0]
    ids = [TINY_IDS["im_start"], TINY_IDS["system"], 10, *tiny_encode("look"), TINY_IDS["im_end"], 10,
           TINY_IDS["im_start"], TINY_IDS["user"], 10, *IMAGE, *VIDEO, *tiny_encode("what is it"),
           TINY_IDS["im_end"], 10, TINY_IDS["im_start"], TINY_IDS["assistant"], 10]
    direct = run(runner, {"token_ids": ids, "images": images, "videos": videos})[0]
    assert via_messages.keys() == direct.keys() and via_messages["token_ids"] == direct["token_ids"]
    for key in ("visual_embeds", "visual_deepstack"):
        assert torch.equal(via_messages[key], direct[key])
    with pytest.raises(AdmissionError, match=r"messages\[0\].images: only user turns carry images"):
        runner.admit(WorkItem("r", WorkKind.NEW, {"messages": [{"role": "system", "content": "", "images": images}]}))
    with pytest.raises(AdmissionError, match="either messages or token_ids"):
        runner.admit(WorkItem("r", WorkKind.NEW, {"messages": messages, "images": images}))


def frame_peak(frame_len: int, num_frames: int) -> int:
    return peak_activation_bytes(CFG.thinker.vision, 4, frame_len * num_frames, frame_len)


@torch.inference_mode()
def test_a_video_chunked_to_fit_equals_it_unchunked(towers: tuple[AudioEncoder, VisionEncoder]) -> None:
    whole, chunked = make_runner(towers), make_runner(towers, frame_peak(FRAME, 3))
    payloads = [{"token_ids": prompt(VIDEO, IMAGE), "videos": [video(16, 6)], "images": [pixels((64, 64, 3), 7)]},
                {"token_ids": prompt(IMAGE), "images": [pixels((50, 30, 3), 8)]}]
    admitted = [chunked.admit(WorkItem(f"r{i}", WorkKind.NEW, p)).payload["vision"] for i, p in enumerate(payloads)]
    assert chunked.vision_config is not None and whole.vision_config is not None
    forwards = forward_inputs(admitted, chunked.vision_config)
    # NOTE: 8 frames, 3 per forward; the two small images ride along with the last two frames.
    assert [[grid for _, grid in f] for f in forwards] == [[(3, 25, 21)], [(3, 25, 21)],
                                                          [(2, 25, 21), (1, 4, 4), (1, 5, 3)]]
    assert len(forward_inputs(admitted, whole.vision_config)) == 1
    for a, b in zip(run(whole, *payloads), run(chunked, *payloads), strict=True):
        assert a.keys() == b.keys() and a["token_ids"] == b["token_ids"]
        assert torch.equal(a["visual_embeds"], b["visual_embeds"])
        assert torch.equal(a["visual_deepstack"], b["visual_deepstack"])


@torch.inference_mode()
def test_an_item_that_cannot_fit_is_refused_and_its_neighbours_complete(
    towers: tuple[AudioEncoder, VisionEncoder],
) -> None:
    budget = frame_peak(FRAME, 2)
    runner = make_runner(towers, budget)
    big = pixels((640, 480, 3), 9)  # NOTE: one frame of 40 x 30 patches: its attention scores alone are over
    assert frame_peak(40 * 30, 1) > budget
    payloads = [{"token_ids": prompt(VIDEO), "videos": [video(16, 10)]},
                {"token_ids": prompt(IMAGE, IMAGE), "images": [pixels((20, 20, 3), 11), big]},
                {"token_ids": prompt(IMAGE), "images": [pixels((64, 80, 3), 12)]}]
    admitted, refusals = [], []
    for i, payload in enumerate(payloads):
        try:
            admitted.append(runner.admit(WorkItem(f"r{i}", WorkKind.NEW, payload)))
        except AdmissionError as exc:
            refusals.append(str(exc))
    assert refusals == [f"payload.images[1]: one frame of 640x480 pixels (after resizing; 40x30 patches) needs "
                        f"{frame_peak(40 * 30, 1) / 2**30:.2f} GiB of activations; the stage's activation budget "
                        f"(factory_args.activation_budget_mb) is {budget / 2**30:.2f} GiB"]
    emits = runner.execute(SimpleBatch(tuple(admitted))).emits
    assert [e.request_id for e in emits] == ["r0", "r2"] and all(e.payload["visual_embeds"].shape[0] for e in emits)


@pytest.mark.parametrize(("payload", "needle"), [
    ({"token_ids": prompt(IMAGE), "images": [b"not an image"]}, "payload.images[0]: not a decodable image"),
    ({"token_ids": prompt(IMAGE), "images": [pixels((8, 8, 3), 0).astype(np.float32)]},
     "payload.images[0]: image array must be uint8"),
    ({"token_ids": prompt(IMAGE), "images": pixels((8, 8, 3), 0)}, "payload.images: must be a list"),
    ({"token_ids": prompt(VIDEO), "videos": [{"frames": pixels((4, 8, 8, 3), 0)}]},
     "payload.videos[0]: a video is {'frames': THWC uint8 array, 'fps': number}, got ['frames']"),
    ({"token_ids": prompt(VIDEO), "videos": [{"frames": pixels((4, 8, 8, 3), 0), "fps": 0}]},
     "payload.videos[0].fps: must be a number > 0"),
    ({"token_ids": prompt(VIDEO), "videos": [{"frames": pixels((4, 8, 8), 0), "fps": 1}]},
     "payload.videos[0].frames: video frames must be TxHxWxC"),
    ({"token_ids": prompt(IMAGE), "images": [png(pixels((8, 8, 3), 0))] * 2},
     "payload.images: 2 images, but payload.token_ids has 1 image blocks"),
    ({"token_ids": prompt(), "videos": [video(4, 0)]}, "payload.videos: 1 videos, but payload.token_ids has 0 video"),
    ({"token_ids": prompt([TINY_IDS["image"]]), "images": [png(pixels((8, 8, 3), 0))]}, "payload.token_ids[3]: image"),
    ({"token_ids": prompt(IMAGE[:1] + [TINY_IDS["image"], TINY_IDS["video"]] + IMAGE[2:]),
      "images": [png(pixels((8, 8, 3), 0))]}, "vision block 0 must be vision_start, image or video placeholder(s)"),
    ({"token_ids": prompt(IMAGE[:2] + IMAGE[1:]), "images": [png(pixels((8, 8, 3), 0))]},
     "payload.token_ids: image block 0 has 2 placeholders; give 1 or its image's exact count 16"),
    ({"images": [png(pixels((8, 8, 3), 0))]}, "payload.token_ids: with images or videos, must be a list"),
    ({"token_ids": prompt(IMAGE)}, "payload.images: the prompt has image blocks but no images were given"),
    ({"token_ids": prompt(VIDEO), "videos": []}, "payload.videos: the prompt has video blocks but no videos"),
])
def test_malformed_vision_input_is_refused_naming_the_field(
    towers: tuple[AudioEncoder, VisionEncoder], payload: dict[str, Any], needle: str,
) -> None:
    with pytest.raises(AdmissionError) as exc:
        make_runner(towers).admit(WorkItem("r", WorkKind.NEW, payload))
    assert needle in str(exc.value)


def test_a_stage_without_vision_refuses_images_and_videos(towers: tuple[AudioEncoder, VisionEncoder]) -> None:
    runner = make_runner(towers, budget_bytes=None)
    for key, value in (("images", [png(pixels((8, 8, 3), 0))]), ("videos", [video(4, 0)])):
        with pytest.raises(AdmissionError, match=f"payload.{key}: this pipeline does not take {key}"):
            runner.admit(WorkItem("r", WorkKind.NEW, {"token_ids": prompt(IMAGE), key: value}))
    assert run(runner, {"token_ids": prompt(), "images": []}) == [{"token_ids": prompt()}]
