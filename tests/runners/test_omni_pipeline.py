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
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from harness import Pipeline, shm_segments
from omni_reference import hf_turn, save_reference

from voice_server.config import pipeline_from_dict
from voice_server.engine.requests import RequestError
from voice_server.models.qwen3_omni.audio.encoder import num_audio_tokens
from voice_server.models.qwen3_omni.audio.mel import LogMelFrontEnd
from voice_server.models.qwen3_omni.code2wav.streaming import lookahead_samples
from voice_server.models.qwen3_omni.config import Qwen3OmniConfig
from voice_server.models.qwen3_omni.presets import tiny_prompt_ids

torch.set_num_threads(1)
MAX_NEW_TOKENS = 6
MAX_FRAMES = 7


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> tuple[torch.nn.Module, Path]:
    ckpt: Path = tmp_path_factory.mktemp("tiny_qwen3_omni")
    return save_reference(ckpt), ckpt


def omni_config(ckpt: Path) -> dict[str, Any]:
    common = {"checkpoint": str(ckpt), "num_threads": 1}
    return {
        "name": "omni-test",
        "stages": [
            {"name": "encoder", "factory": "voice_server.stages.audio_encoder:create_audio_encoder",
             "next": "thinker", "max_batch_size": 4, "factory_args": common},
            {"name": "thinker", "factory": "voice_server.stages.thinker:create_thinker", "scheduler": "ar",
             "terminal": True, "stream_to": ["talker"], "max_batch_size": 8, "max_step_tokens": 64,
             "factory_args": {**common, "sampling": {"max_tokens": MAX_NEW_TOKENS}}},
            # NOTE: terminal here so the test sees the codes; a deployment streams only text and audio.
            {"name": "talker", "factory": "voice_server.stages.talker:create_talker", "scheduler": "ar",
             "terminal": True, "stream_to": ["code2wav"], "max_batch_size": 8, "max_step_tokens": 64,
             "factory_args": {**common, "max_frames": MAX_FRAMES}},
            {"name": "code2wav", "factory": "voice_server.stages.code2wav:create_code2wav", "scheduler": "code2wav",
             "terminal": True, "max_batch_size": 8, "factory_args": common},
        ],
    }


@pytest.fixture(scope="module")
def omni(reference: tuple[torch.nn.Module, Path]) -> Iterator[Pipeline]:
    pipeline = Pipeline(pipeline_from_dict(omni_config(reference[1])))
    yield pipeline
    pipeline.close()
    assert shm_segments(pipeline.coordinator.launch_id) == []


def _pcm(num_samples: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    t = np.arange(num_samples) / 16000
    wave = 0.3 * np.sin(2 * np.pi * (180 + 20 * seed) * t) * (1 + np.sin(2 * np.pi * 3 * t))
    return (wave + 0.01 * rng.standard_normal(t.size)).astype(np.float32)


# Reply tokens and frames per request: replies shorter than their audio (the talker pads after
# tts_eos) and longer (the talker stops first, the thinker goes on), in both text and audio prompts.
LIMITS = [(3, 7), (12, 5), (6, 12), (9, 9), (4, 4), (10, 14), (5, 6), (8, 11)]


def requests() -> list[tuple[dict[str, Any], dict[str, Any]]]:
    """(our payload, the reference's generate kwargs): text prompts and audio prompts of different lengths."""
    out = []
    for num_text in (2, 9, 4, 14, 6):
        ids = tiny_prompt_ids(num_user_text=num_text)
        out.append(({"token_ids": ids}, {"input_ids": torch.tensor([ids])}))
    for seed, num_samples in ((1, 12_000), (2, 19_000), (3, 27_000)):
        pcm = _pcm(num_samples, seed)
        mel = LogMelFrontEnd(num_mel_bins=16)([pcm])
        full = tiny_prompt_ids(num_user_text=3, num_audio_tokens=num_audio_tokens(int(mel.feature_lens[0])))
        ours = {"token_ids": tiny_prompt_ids(num_user_text=3, num_audio_tokens=1), "audio": [pcm]}
        out.append((ours, {"input_ids": torch.tensor([full]), "input_features": mel.features,
                           "feature_attention_mask": mel.attention_mask,
                           "attention_mask": torch.ones(1, len(full), dtype=torch.long)}))
    return out


def submit_all(
    omni: Pipeline, payloads: list[dict[str, Any]], params: list[dict[str, Any]], stagger_s: float,
) -> list[list[Any]]:
    async def one(i: int, payload: dict[str, Any]) -> list[Any]:
        await asyncio.sleep(i * stagger_s)
        return [o async for o in omni.coordinator.submit(payload, params[i])]

    async def go() -> list[list[Any]]:
        return await asyncio.gather(*(one(i, p) for i, p in enumerate(payloads)), return_exceptions=True)

    return omni.run(go(), timeout=300)


def by_stage(outputs: list[Any], stage: str) -> list[dict[str, Any]]:
    return [o.payload for o in outputs if o.stage == stage]


def test_eight_staggered_requests_stream_what_the_reference_generates(
    omni: Pipeline, reference: tuple[torch.nn.Module, Path]
) -> None:
    ref, ckpt = reference
    cases = requests()
    params = [{"sampling": {"max_tokens": n}, "talker": {"max_frames": f}} for n, f in LIMITS]
    outputs = submit_all(omni, [payload for payload, _ in cases], params, stagger_s=0.1)
    lookahead = lookahead_samples(Qwen3OmniConfig.from_json_file(ckpt).code2wav)
    for (_, kwargs), (max_new_tokens, max_frames), got in zip(cases, LIMITS, outputs, strict=True):
        assert not isinstance(got, BaseException), got
        text_ids, codes, wav = (t[0] for t in hf_turn(ref, max_new_tokens, max_frames, **kwargs))
        wav = wav.reshape(-1)
        thinker = by_stage(got, "thinker")
        assert all(not any(k.startswith("_") for k in p) for p in thinker), "the talker feed is not the client's"
        assert kwargs["input_ids"][0].tolist() + thinker[-1]["token_ids"] == text_ids.tolist()
        frames = [torch.tensor(np.array(p["codes"])) for p in by_stage(got, "talker") if "codes" in p]
        assert frames and torch.equal(torch.cat(frames, dim=1), codes)
        pcm = torch.cat([torch.tensor(np.array(p["pcm"])).reshape(-1) for p in by_stage(got, "code2wav") if "pcm" in p])
        assert pcm.shape[0] == wav.shape[0] + lookahead
        err = (pcm[: wav.shape[0]] - wav).abs().max().item()
        assert err <= 1e-4, err
        assert wav.abs().max() > 1e-3
        # The first-audio accounting: each stage's first output, in pipeline order, on one clock.
        stamps = next(o.timings for o in got if o.stage == "code2wav")
        order = ["submit", "encoder", "thinker", "talker", "code2wav"]
        assert [stamps[k] for k in order] == sorted(stamps[k] for k in order), stamps
        print(f"prompt {len(kwargs['input_ids'][0])} tokens: {len(thinker[-1]['token_ids'])} reply tokens, "
              f"{codes.shape[-1]} frames, {pcm.shape[0]} samples, max err {err:.1e}, first audio "
              f"{1000 * (stamps['code2wav'] - stamps['submit']):.0f} ms")


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


def test_a_request_refused_by_one_stage_fails_alone(omni: Pipeline, reference: tuple[torch.nn.Module, Path]) -> None:
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


def test_all_stages_in_one_process_stream_the_same(reference: tuple[torch.nn.Module, Path]) -> None:
    # NOTE: one `process` group runs the four schedulers round-robin in one shell; results must not change.
    ref, ckpt = reference
    cfg = omni_config(ckpt)
    for stage in cfg["stages"]:
        stage["process"] = "omni"
    pipeline = Pipeline(pipeline_from_dict(cfg))
    try:
        cases = [requests()[i] for i in (1, 6)]  # one text prompt, one audio prompt
        limits = [LIMITS[i] for i in (1, 6)]
        params = [{"sampling": {"max_tokens": n}, "talker": {"max_frames": f}} for n, f in limits]
        outputs = submit_all(pipeline, [payload for payload, _ in cases], params, stagger_s=0.05)
        for (_, kwargs), (max_new_tokens, max_frames), got in zip(cases, limits, outputs, strict=True):
            assert not isinstance(got, BaseException), got
            _, codes, wav = (t[0] for t in hf_turn(ref, max_new_tokens, max_frames, **kwargs))
            frames = [torch.tensor(np.array(p["codes"])) for p in by_stage(got, "talker") if "codes" in p]
            assert torch.equal(torch.cat(frames, dim=1), codes)
            pcm = torch.cat([torch.tensor(np.array(p["pcm"])).reshape(-1) for p in by_stage(got, "code2wav")
                             if "pcm" in p])
            assert (pcm[: wav.numel()] - wav.reshape(-1)).abs().max().item() <= 1e-4
    finally:
        pipeline.close()
    assert shm_segments(pipeline.coordinator.launch_id) == []
