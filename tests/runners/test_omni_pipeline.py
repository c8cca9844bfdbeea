"""The streaming Qwen3-Omni pipeline (encoder -> thinker -> talker -> code2wav, one process each) on
the tiny config against transformers' `generate(return_audio=True)` on the same weights.

The tiny HF model is written with `save_pretrained` and every stage loads its part from that folder.
Per request: the thinker's text ids, the talker's codes and the streamed waveform equal the
reference's (waveform within 1e-4; ours also streams the decoder's last `lookahead` samples, which
the reference trims). Also: aborts free every page and stream, and a request that fails in one
stage ends with an error while the others complete.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import torch
from harness import Pipeline, shm_segments
from omni_reference import LIMITS, TinyOmni, by_stage, omni_config

from voice_server.config import pipeline_from_dict
from voice_server.engine.requests import RequestError
from voice_server.models.qwen3_omni.presets import tiny_prompt_ids

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def omni(reference: TinyOmni) -> Iterator[Pipeline]:
    pipeline = Pipeline(pipeline_from_dict(omni_config(reference.ckpt)))
    yield pipeline
    pipeline.close()
    assert shm_segments(pipeline.coordinator.launch_id) == []


def test_eight_staggered_requests_stream_what_the_reference_generates(omni: Pipeline, reference: TinyOmni) -> None:
    params = [{"sampling": {"max_tokens": n}, "talker": {"max_frames": f}} for n, f in LIMITS]
    outputs = omni.collect_all([payload for payload, _ in reference.cases], params, stagger_s=0.1, timeout=300)
    for case, ((max_new_tokens, max_frames), got) in enumerate(zip(LIMITS, outputs, strict=True)):
        assert not isinstance(got, BaseException), got
        summary = reference.check(case, max_new_tokens, max_frames, got)
        # The first-audio accounting: each stage's first output, in pipeline order, on one clock.
        stamps = next(o.timings for o in got if o.stage == "code2wav")
        order = ["submit", "encoder", "thinker", "talker", "code2wav"]
        assert [stamps[k] for k in order] == sorted(stamps[k] for k in order), stamps
        print(f"{summary}, first audio {1000 * (stamps['code2wav'] - stamps['submit']):.0f} ms")


def counters(omni: Pipeline, stage: str) -> dict[str, int]:
    return omni.run(omni.coordinator.stats())[stage].counters[stage]


def wait_idle(omni: Pipeline) -> None:
    deadline = time.monotonic() + 10
    while True:
        busy = {s: c for s in ("thinker", "talker") if (c := counters(omni, s))["num_used_pages"] or c["num_running"]}
        if not busy:
            return
        assert time.monotonic() < deadline, busy
        time.sleep(0.05)


def test_abort_mid_stream_frees_both_ar_stages_and_ends_the_vocoder_stream(omni: Pipeline) -> None:
    long_reply = {"token_ids": tiny_prompt_ids(num_user_text=5)}

    async def go() -> list[Any]:
        stream = omni.coordinator.submit(long_reply, {"talker": {"max_frames": 4000},
                                                      "sampling": {"max_tokens": 200, "ignore_eos": True}})
        seen = []
        async for out in stream:
            seen.append(out)
            if out.stage == "code2wav":
                break  # first audio is out: the consumer walks away mid-stream
        await stream.aclose()
        return seen

    seen = omni.run(go(), timeout=120)
    assert any(o.stage == "code2wav" for o in seen)
    wait_idle(omni)
    assert counters(omni, "code2wav").get("num_streams", 0) == 0


def test_a_request_refused_by_one_stage_fails_alone(omni: Pipeline) -> None:
    good = {"token_ids": tiny_prompt_ids(num_user_text=4)}

    async def go() -> list[Any]:
        async def run(payload: dict[str, Any], params: dict[str, Any]) -> Any:
            try:
                return [o async for o in omni.coordinator.submit(payload, params)]
            except RequestError as exc:
                return exc
        return await asyncio.gather(run(good, {}), run(good, {"talker": {"speaker": "nobody"}}), run(good, {}))

    first, bad, last = omni.run(go(), timeout=120)
    assert isinstance(bad, RequestError) and "speaker" in str(bad)
    for got in (first, last):
        assert not isinstance(got, RequestError)
        assert any(o.stage == "code2wav" and o.is_final for o in got)
    wait_idle(omni)


def test_all_stages_in_one_process_stream_the_same(reference: TinyOmni) -> None:
    # NOTE: one `process` group runs the four schedulers round-robin in one shell; results must not change.
    cfg = omni_config(reference.ckpt)
    for stage in cfg["stages"]:
        stage["process"] = "omni"
    pipeline = Pipeline(pipeline_from_dict(cfg))
    try:
        cases = (1, 6)  # one text prompt, one audio prompt
        params = [{"sampling": {"max_tokens": LIMITS[i][0]}, "talker": {"max_frames": LIMITS[i][1]}} for i in cases]
        outputs = pipeline.collect_all([reference.cases[i][0] for i in cases], params, stagger_s=0.05, timeout=300)
        for case, got in zip(cases, outputs, strict=True):
            assert not isinstance(got, BaseException), got
            reference.check(case, *LIMITS[case], got)
    finally:
        pipeline.close()
    assert shm_segments(pipeline.coordinator.launch_id) == []


def test_a_bf16_pipeline_hands_its_bf16_embeddings_to_the_talker(reference: TinyOmni) -> None:
    # NOTE: bf16 is the default on CUDA; the thinker's per-token embeddings then cross the relay as bf16,
    # which numpy cannot hold. They once arrived as integer bits and the talker refused every request
    # ("must be a float array"); first seen on an H200. bf16 runs on CPU too, so it is checked here.
    cfg = omni_config(reference.ckpt)
    for stage in cfg["stages"]:
        stage["factory_args"] = {**stage["factory_args"], "dtype": "bf16"}
    pipeline = Pipeline(pipeline_from_dict(cfg))
    try:
        cases = (1, 6)  # one text prompt, one audio prompt
        params = [{"sampling": {"max_tokens": LIMITS[i][0]}, "talker": {"max_frames": LIMITS[i][1]}} for i in cases]
        outputs = pipeline.collect_all([reference.cases[i][0] for i in cases], params, stagger_s=0.05, timeout=300)
        num_spoken = 0
        for got in outputs:
            assert not isinstance(got, BaseException), got  # the talker took every chunk's embedding
            assert by_stage(got, "thinker")[-1]["token_ids"]
            pcm = [np.asarray(p["pcm"], np.float32).reshape(-1) for p in by_stage(got, "code2wav") if "pcm" in p]
            if any("codes" in p for p in by_stage(got, "talker")) and pcm:
                whole = np.concatenate(pcm)
                assert np.isfinite(whole).all()
                num_spoken += int(np.abs(whole).max() > 1e-3)
        # NOTE: bf16 picks may differ from fp32's by CPU (random weights): one reply may end at once, not both.
        assert num_spoken >= 1
    finally:
        pipeline.close()
    assert shm_segments(pipeline.coordinator.launch_id) == []
