"""The audio encoder stage (`stages/audio_encoder.py`) as a pipeline's entry, in real stage processes:
concurrent requests (two with audio of different lengths, one text-only) reach the next stage with
the audio embeddings (through the relay) and expanded token ids; a malformed request fails alone."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import torch
from harness import Pipeline, shm_segments

from voice_server.config import pipeline_from_dict
from voice_server.engine.coordinator import RequestError
from voice_server.models.qwen3_omni.audio.encoder import num_audio_tokens
from voice_server.models.qwen3_omni.audio.mel import LogMelFrontEnd
from voice_server.models.qwen3_omni.config import Qwen3OmniConfig
from voice_server.models.qwen3_omni.loading import load_part
from voice_server.models.qwen3_omni.presets import TINY_IDS, tiny_config_dict, tiny_prompt_ids
from voice_server.models.qwen3_omni.thinker.model import ThinkerModel

torch.set_num_threads(1)
SEED = 3


@pytest.fixture(scope="module")
def omni() -> Iterator[Pipeline]:
    cfg = pipeline_from_dict({
        "name": "omni-encoder",
        "stages": [
            {"name": "encoder", "factory": "voice_server.stages.audio_encoder:create_audio_encoder",
             "next": "recorder", "memory_fraction": 0.01, "max_batch_size": 4, "batch_window_ms": 300,
             "factory_args": {"preset": "tiny", "seed": SEED, "num_threads": 1, "max_audio_seconds": 5}},
            {"name": "recorder", "factory": "omni_stages:create_recorder", "terminal": True,
             "memory_fraction": 0.01},
        ],
    })
    pipeline = Pipeline(cfg)
    yield pipeline
    pipeline.close()
    assert shm_segments(pipeline.coordinator.launch_id) == []


def pcm(seconds: float, seed: int) -> np.ndarray:
    g = torch.Generator().manual_seed(seed)
    return (0.3 * torch.randn(int(seconds * 16000), generator=g)).numpy()


def with_audio(clip: np.ndarray) -> dict[str, Any]:
    ids = tiny_prompt_ids(num_user_text=4, num_audio_tokens=1)
    return {"token_ids": ids, "audio": [clip], "note": {"kept": "x"}}


@torch.no_grad()
def test_concurrent_requests_reach_the_next_stage_encoded(omni: Pipeline) -> None:
    long_clip, short_clip = pcm(2.6, 1), pcm(0.7, 2)
    text_only = {"token_ids": tiny_prompt_ids(num_user_text=5), "note": {"kept": "y"}}
    results = omni.collect_all([with_audio(long_clip), text_only, with_audio(short_clip)])
    got = [outputs[-1].payload for outputs in results]
    assert got[1] == {**text_only, "received_keys": sorted(text_only)}
    cfg = Qwen3OmniConfig.from_hf_dict(tiny_config_dict())
    thinker = load_part("thinker", cfg, load_format="dummy", seed=SEED)
    assert isinstance(thinker, ThinkerModel)
    front_end = LogMelFrontEnd(num_mel_bins=cfg.thinker.audio.num_mel_bins)
    for clip, payload in ((long_clip, got[0]), (short_clip, got[2])):
        assert payload["received_keys"] == ["audio_embeds", "audio_token_counts", "note", "token_ids"]
        mel = front_end([clip])
        want = thinker.encode_audio(mel.packed(), mel.feature_lens, chunk_pad_len=100)
        (count,) = payload["audio_token_counts"]
        assert count == want.shape[0]
        embeds = torch.from_numpy(np.array(payload["audio_embeds"]))
        torch.testing.assert_close(embeds, want, atol=1e-6, rtol=1e-5)
        want_ids = tiny_prompt_ids(num_user_text=4, num_audio_tokens=count)
        assert payload["token_ids"] == want_ids and want_ids.count(TINY_IDS["audio"]) == count
    assert got[0]["audio_token_counts"][0] > got[2]["audio_token_counts"][0]


def test_a_malformed_request_fails_alone(omni: Pipeline) -> None:
    bad = with_audio(pcm(1.0, 3).astype(np.float64))
    too_long = with_audio(pcm(5.5, 4))
    good = with_audio(pcm(1.2, 5))
    results = omni.collect_all([bad, good, too_long])
    assert isinstance(results[0], RequestError) and "payload.audio[0]: samples must be float32" in str(results[0])
    assert isinstance(results[2], RequestError) and "payload.audio[0]: has 88000 samples" in str(results[2])
    (num_frames,) = LogMelFrontEnd().feature_lens([good["audio"][0].shape[0]])
    assert results[1][-1].payload["audio_token_counts"] == [num_audio_tokens(num_frames)]
