"""Vision turns through a streaming Qwen3-Omni pipeline and the greedy turn they must equal (the pipeline tests
tests/runners/test_omni_vision_pipeline.py and tests/runners/test_omni_vision_encoder_pipeline.py).

NOTE: transformers cannot speak a prompt with audio and images or videos: its talker's `get_rope_index` reads
`audio_config.n_window` off the talker's config, which has none (AttributeError in `generate(return_audio=True)`).
For such a prompt the reference is transformers' thinker `generate` for the text ids and `run_greedy_turn` (whose
talker matches transformers' on vision prompts and on audio prompts apart) for the codes and waveform, on the same
text ids; for every other prompt it is transformers' `generate(return_audio=True)`.
"""

from __future__ import annotations

import asyncio
from typing import Any

import numpy as np
import torch
from harness import Pipeline
from omni_reference import hf_turn

from voice_server.models.qwen3_omni.code2wav.streaming import lookahead_samples
from voice_server.models.qwen3_omni.presets import TINY_IDS
from voice_server.models.qwen3_omni.thinker.visual import VisualInputs
from voice_server.models.qwen3_omni.turn import TurnModels, run_greedy_turn

Limits = tuple[int, int]
"""(reply tokens, frames) at most."""


def params_of(limits: Limits) -> dict[str, Any]:
    return {"sampling": {"max_tokens": limits[0]}, "talker": {"max_frames": limits[1]}}


def submit_all(omni: Pipeline, payloads: list[dict[str, Any]], limits: list[Limits], stagger_s: float) -> list[Any]:
    """Every request's outputs (or its exception), the i-th submitted i * stagger_s after the first."""
    async def one(i: int, payload: dict[str, Any]) -> list[Any]:
        await asyncio.sleep(i * stagger_s)
        return [o async for o in omni.coordinator.submit(payload, params_of(limits[i]))]

    async def go() -> list[Any]:
        return await asyncio.gather(*(one(i, p) for i, p in enumerate(payloads)), return_exceptions=True)

    return omni.run(go(), timeout=300)


def by_stage(outputs: list[Any], stage: str) -> list[dict[str, Any]]:
    return [o.payload for o in outputs if o.stage == stage]


def reference_turn(
    ref: torch.nn.Module, ours: TurnModels, input_ids: torch.Tensor, media: dict[str, Any], visual: VisualInputs | None,
    limits: Limits,
) -> tuple[torch.Tensor, ...]:
    """(text ids [L], codes [G, T], waveform [samples]) of the greedy turn for input_ids [1, L] with transformers'
    inputs `media`; `visual` (the rows the pipeline's thinker was given) is read only where transformers cannot
    speak the prompt (see the module's note)."""
    is_vision = "pixel_values" in media or "pixel_values_videos" in media
    if not ("input_features" in media and is_vision):
        return tuple(t[0] for t in hf_turn(ref, *limits, input_ids=input_ids, **media))
    with torch.no_grad():
        text_ids = ref.generate(input_ids=input_ids, return_audio=False, thinker_max_new_tokens=limits[0],
                                thinker_do_sample=False, thinker_eos_token_id=TINY_IDS["im_end"], **media)
    mask = media["feature_attention_mask"]
    packed = media["input_features"].permute(0, 2, 1)[mask.bool()].permute(1, 0)
    turn = run_greedy_turn(ours, input_ids, *limits, input_features=packed, feature_lens=mask.sum(-1), visual=visual)
    assert torch.equal(turn.text_ids, text_ids)
    return text_ids[0], turn.codes[0], turn.waveform[0]


def check_streamed(ours: TurnModels, input_ids: torch.Tensor, expected: tuple[torch.Tensor, ...], got: list[Any]
                   ) -> str:
    """The pipeline's text ids and codes equal `expected`'s (`reference_turn`), its waveform within 1e-4 (it also
    streams the decoder's last `lookahead` samples, which the reference trims); a line describing the turn."""
    text_ids, codes, wav = expected
    thinker = by_stage(got, "thinker")
    assert input_ids[0].tolist() + thinker[-1]["token_ids"] == text_ids.tolist()
    frames = [torch.tensor(np.array(p["codes"])) for p in by_stage(got, "talker") if "codes" in p]
    assert frames and torch.equal(torch.cat(frames, dim=1), codes)
    pcm = torch.cat([torch.tensor(np.array(p["pcm"])).reshape(-1) for p in by_stage(got, "code2wav") if "pcm" in p])
    wav = wav.reshape(-1)
    assert pcm.shape[0] == wav.shape[0] + lookahead_samples(ours.cfg.code2wav)
    err = (pcm[: wav.shape[0]] - wav).abs().max().item()
    assert err <= 1e-4, err
    return (f"prompt {input_ids.shape[1]} tokens: {len(thinker[-1]['token_ids'])} reply tokens, "
            f"{codes.shape[-1]} frames, max err {err:.1e}")
