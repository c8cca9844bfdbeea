"""The encoder stage with `vision: true` as a pipeline's entry, in real stage processes: images (encoded bytes
and arrays) and a video travel through the relay, the next stage receives the visual embeddings the runner
computes in-process, a video longer than the activation budget runs chunked, and an image too large for the
budget fails alone while the requests beside it complete."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest
import torch
from harness import Pipeline, shm_segments
from image_inputs import pixels, png

from voice_server.config import pipeline_from_dict
from voice_server.engine.coordinator import RequestError
from voice_server.engine.runtime import StageContext
from voice_server.models.qwen3_omni.presets import TINY_IDS, tiny_prompt_ids
from voice_server.runners.vision_input import RESULT_KEYS, forward_inputs
from voice_server.runners.vision_plan import peak_activation_bytes
from voice_server.scheduling import SimpleBatch, WorkItem, WorkKind
from voice_server.stages.audio_encoder import create_audio_encoder

torch.set_num_threads(1)
BUDGET_MB = 12
ENCODER = {"name": "encoder", "factory": "voice_server.stages.audio_encoder:create_audio_encoder",
           "next": "recorder", "memory_fraction": 0.01, "max_batch_size": 4, "batch_window_ms": 300,
           "factory_args": {"preset": "tiny", "seed": 2, "num_threads": 1, "vision": True,
                            "activation_budget_mb": BUDGET_MB}}
IMAGE = [TINY_IDS["vision_start"], TINY_IDS["image"], TINY_IDS["vision_end"]]
VIDEO = [TINY_IDS["vision_start"], TINY_IDS["video"], TINY_IDS["vision_end"]]


@pytest.fixture(scope="module")
def omni() -> Iterator[Pipeline]:
    cfg = pipeline_from_dict({"name": "omni-vision", "stages": [
        ENCODER, {"name": "recorder", "factory": "omni_stages:create_recorder", "terminal": True,
                  "memory_fraction": 0.01}]})
    pipeline = Pipeline(cfg)
    yield pipeline
    pipeline.close()
    assert shm_segments(pipeline.coordinator.launch_id) == []


def prompt(*blocks: list[int]) -> list[int]:
    base = tiny_prompt_ids(num_user_text=3)
    return base[:3] + [t for b in blocks for t in b] + base[3:]


@torch.inference_mode()
def test_images_and_video_reach_the_next_stage_and_a_too_large_image_fails_alone(omni: Pipeline) -> None:
    video = {"frames": pixels((16, 48, 40, 3), 1), "fps": 2.0}  # NOTE: 8 temporal patches of 25 x 21 patches
    payloads = [{"token_ids": prompt(VIDEO, IMAGE), "videos": [video], "images": [png(pixels((40, 56, 3), 2))],
                 "note": "kept"},
                {"token_ids": prompt(IMAGE), "images": [pixels((1600, 1200, 3), 3)]},
                {"token_ids": prompt(IMAGE), "images": [pixels((30, 20), 4)]}]
    results = omni.collect_all(payloads)
    assert isinstance(results[1], RequestError)
    assert "payload.images[0]: one frame of 1600x1200 pixels" in str(results[1])
    assert f"activation budget (factory_args.activation_budget_mb) is {BUDGET_MB / 1024:.2f} GiB" in str(results[1])
    alone = pipeline_from_dict({"name": "x", "stages": [{**ENCODER, "next": None, "terminal": True}]})
    runner = create_audio_encoder(StageContext(alone.stages[0], alone, None, "t"))  # NOTE: the same weights
    assert runner.vision_config is not None and runner.vision_config.activation_budget_bytes == BUDGET_MB * 2**20
    frame = 25 * 21
    assert peak_activation_bytes(runner.vision_config.tower, 4, 8 * frame, frame) > BUDGET_MB * 2**20
    for i in (0, 2):
        got = results[i][-1].payload
        item = runner.admit(WorkItem("r", WorkKind.NEW, payloads[i]))
        if i == 0:
            assert len(forward_inputs([item.payload["vision"]], runner.vision_config)) > 1  # NOTE: chunked
        (emit,) = runner.execute(SimpleBatch((item,))).emits
        want = emit.payload
        assert got["received_keys"] == sorted(want)
        assert set(RESULT_KEYS) <= set(got["received_keys"]) and got["token_ids"] == want["token_ids"]
        for key in ("visual_embeds", "visual_deepstack"):
            torch.testing.assert_close(torch.from_numpy(np.array(got[key])), want[key], atol=1e-6, rtol=1e-5)
        for key in ("image_grid_thw", "video_grid_thw", "video_second_per_grid"):
            assert got[key] == want[key]
    assert results[0][-1].payload["note"] == "kept" and results[0][-1].payload["video_grid_thw"] == [[8, 25, 21]]
