"""The `code2wav` scheduler and Code2Wav runner in real stage processes: an upstream stage streams
codec frames (tests/omni_stages.py) into the vocoder stage; each request's concatenated PCM equals
the full decode of its frames, a malformed chunk fails only its request, an abort ends one stream."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import torch
from harness import Pipeline, shm_segments
from omni_stages import code_frames

from voice_server.config import pipeline_from_dict
from voice_server.engine.coordinator import RequestError
from voice_server.models.qwen3_omni.code2wav.model import Code2Wav
from voice_server.models.qwen3_omni.config import Qwen3OmniConfig
from voice_server.models.qwen3_omni.loading import load_part
from voice_server.models.qwen3_omni.presets import tiny_config_dict

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def voc() -> Iterator[Pipeline]:
    cfg = pipeline_from_dict({
        "name": "code2wav",
        "stages": [
            {"name": "codes", "factory": "omni_stages:create_code_streamer", "stream_to": ["voc"],
             "memory_fraction": 0.01, "max_batch_size": 1},
            {"name": "voc", "factory": "voice_server.stages.code2wav:create_code2wav", "scheduler": "code2wav",
             "terminal": True, "memory_fraction": 0.01, "max_batch_size": 4,
             "factory_args": {"preset": "tiny", "num_threads": 1}},
        ],
    })
    pipeline = Pipeline(cfg)
    yield pipeline
    pipeline.close()
    assert shm_segments(pipeline.coordinator.launch_id) == []


@pytest.fixture(scope="module")
def model() -> Code2Wav:
    cfg = Qwen3OmniConfig.from_hf_dict(tiny_config_dict(), where="preset tiny")
    part = load_part("code2wav", cfg, None, load_format="dummy", dtype=torch.float32, device="cpu", seed=0)
    assert isinstance(part, Code2Wav)
    return part


def full_decode(model: Code2Wav, num_frames: int, seed: int) -> np.ndarray:
    with torch.no_grad():
        return model(code_frames(num_frames, seed)[None], keep_tail=True)[0, 0].numpy()


def pcm_of(outputs: list[Any]) -> np.ndarray:
    pieces = [np.asarray(o.payload["pcm"]) for o in outputs if not o.is_final]
    assert all(p.dtype == np.float32 and p.ndim == 1 for p in pieces)
    assert all(o.payload["sample_rate"] == 24000 for o in outputs if not o.is_final)
    return np.concatenate(pieces) if pieces else np.zeros(0, np.float32)


def submit_all(voc: Pipeline, payloads: list[dict[str, Any]], abort_after: int | None = None) -> list[Any]:
    """Submit concurrently; with `abort_after`, the first request is aborted after that many outputs."""
    async def one(i: int, payload: dict[str, Any]) -> Any:
        stream = voc.coordinator.submit(payload)
        got: list[Any] = []
        try:
            async for out in stream:
                got.append(out)
                if i == 0 and abort_after is not None and len(got) == abort_after:
                    await voc.coordinator.abort(stream.request_id)
        except RequestError as exc:
            return exc
        return got

    async def go() -> list[Any]:
        return await asyncio.gather(*(one(i, p) for i, p in enumerate(payloads)))

    return voc.run(go())


def test_concurrent_streams_each_equal_their_full_decode(voc: Pipeline, model: Code2Wav) -> None:
    payloads = [{"num_frames": n, "seed": s, "chunk_len": k, "chunk_delay_ms": 1}
                for n, s, k in ((57, 1, 3), (23, 2, 7), (1, 3, 1))]
    results = submit_all(voc, payloads)
    for payload, outputs in zip(payloads, results):
        assert not isinstance(outputs, Exception), outputs
        want = full_decode(model, payload["num_frames"], payload["seed"])
        got = pcm_of(outputs)
        assert got.shape == want.shape
        assert np.abs(got - want).max() <= 1e-5
        assert outputs[-1].is_final and outputs[-1].payload == {"num_samples": want.shape[0],
                                                                "num_frames": payload["num_frames"]}
    stats = voc.run(voc.coordinator.stats())["voc"].counters["voc"]
    assert stats["num_streams"] == 0 and stats["num_frames_decoded"] >= 57 + 23 + 1


def test_an_empty_stream_ends_with_an_empty_result(voc: Pipeline) -> None:
    outputs = voc.collect({"num_frames": 0, "seed": 0})
    assert [o.is_final for o in outputs] == [True]
    assert outputs[0].payload == {"num_samples": 0, "num_frames": 0}


def test_a_malformed_chunk_fails_only_its_request(voc: Pipeline, model: Code2Wav) -> None:
    payloads = [{"num_frames": 30, "seed": 4, "chunk_len": 5, "bad_chunk": 2},
                {"num_frames": 30, "seed": 5, "chunk_len": 5}]
    bad, good = submit_all(voc, payloads)
    assert isinstance(bad, RequestError) and "payload.codes" in str(bad)
    assert np.abs(pcm_of(good) - full_decode(model, 30, 5)).max() <= 1e-5


def test_abort_mid_stream_ends_that_stream_and_the_others_complete(voc: Pipeline, model: Code2Wav) -> None:
    payloads = [{"num_frames": 3000, "seed": 6, "chunk_len": 50},
                {"num_frames": 40, "seed": 7, "chunk_len": 4, "chunk_delay_ms": 2},
                {"num_frames": 25, "seed": 8, "chunk_len": 5}]
    aborted, *rest = submit_all(voc, payloads, abort_after=2)
    assert not isinstance(aborted, Exception)
    assert len(aborted) >= 2 and not any(o.is_final for o in aborted)
    assert pcm_of(aborted).shape[0] < full_decode(model, 3000, 6).shape[0]
    for payload, outputs in zip(payloads[1:], rest):
        assert np.abs(pcm_of(outputs) - full_decode(model, payload["num_frames"], payload["seed"])).max() <= 1e-5
    assert wait_idle(voc)["num_streams"] == 0


def wait_idle(voc: Pipeline, timeout_s: float = 5.0) -> dict[str, int]:
    deadline = time.monotonic() + timeout_s
    while True:
        stats = voc.run(voc.coordinator.stats())["voc"].counters["voc"]
        if stats["num_streams"] == 0 or time.monotonic() > deadline:
            return stats
        time.sleep(0.02)
