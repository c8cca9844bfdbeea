"""The transformers Qwen3-Omni reference on the tiny config: one seeded model and one greedy turn.

Shared by the model parity tests and the pipeline tests, so both compare against the same oracle. For the
streaming pipeline tests (tests/runners/test_omni_pipeline.py, tests/runners/test_omni_code2wav_replicas.py):
`omni_config` (encoder -> thinker -> talker -> code2wav over a saved checkpoint), `omni_cases` (text and
audio prompts with the reference's `generate` kwargs) and `TinyOmni.check` (one request's outputs against
the reference turn).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch
import transformers

from voice_server.models.qwen3_omni.audio.encoder import num_audio_tokens
from voice_server.models.qwen3_omni.audio.mel import LogMelFrontEnd
from voice_server.models.qwen3_omni.code2wav.streaming import lookahead_samples
from voice_server.models.qwen3_omni.config import Qwen3OmniConfig
from voice_server.models.qwen3_omni.presets import TINY_IDS, tiny_config_dict, tiny_prompt_ids

MAX_NEW_TOKENS = 6
MAX_FRAMES = 7
LIMITS = [(3, 7), (12, 5), (6, 12), (9, 9), (4, 4), (10, 14), (5, 6), (8, 11)]
"""Reply tokens and frames for each of `omni_cases()`: replies shorter than their audio (the talker pads after
tts_eos) and longer (the talker stops first, the thinker goes on), in both text and audio prompts."""


@torch.no_grad()
def randomize_(model: torch.nn.Module, seed: int = 0) -> None:
    # NOTE: HF leaves the talker experts uninitialised and many params near-trivial; set every one.
    g = torch.Generator().manual_seed(seed)
    for name, p in sorted(model.named_parameters()):
        r = torch.randn(p.shape, generator=g)
        if p.ndim == 1 and "norm" in name:
            p.copy_(1.0 + 0.05 * r)
        else:
            p.copy_(0.1 * r)


def save_reference(ckpt: Path) -> torch.nn.Module:
    """A seeded tiny transformers model, written to `ckpt` with `save_pretrained` (the released layout)."""
    ref = transformers.Qwen3OmniMoeForConditionalGeneration(transformers.Qwen3OmniMoeConfig(**tiny_config_dict()))
    randomize_(ref.eval())
    ref.save_pretrained(ckpt)
    return ref


def hf_turn(ref: torch.nn.Module, max_new_tokens: int, max_frames: int, **kwargs: Any) -> tuple[torch.Tensor, ...]:
    """Greedy `generate(return_audio=True)`: (text ids [1, L], codes [1, G, T] as decoded, waveform)."""
    captured: list[torch.Tensor] = []
    decode = ref.code2wav.chunked_decode

    def spy(codes: torch.Tensor, **kw: object) -> torch.Tensor:
        captured.append(codes.clone())
        return decode(codes, **kw)

    ref.code2wav.chunked_decode = spy
    try:
        with torch.no_grad():
            text_ids, wav = ref.generate(
                speaker="Ethan", thinker_max_new_tokens=max_new_tokens, thinker_do_sample=False,
                thinker_eos_token_id=TINY_IDS["im_end"], talker_max_new_tokens=max_frames + 1,
                talker_do_sample=False, **kwargs,
            )
    finally:
        del ref.code2wav.chunked_decode
    return text_ids, captured[0], wav


def omni_config(ckpt: Path) -> dict[str, Any]:
    """The streaming pipeline, one process per stage, every stage loading its part of `ckpt`."""
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


def _pcm(num_samples: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    t = np.arange(num_samples) / 16000
    wave = 0.3 * np.sin(2 * np.pi * (180 + 20 * seed) * t) * (1 + np.sin(2 * np.pi * 3 * t))
    return (wave + 0.01 * rng.standard_normal(t.size)).astype(np.float32)


def omni_cases() -> list[tuple[dict[str, Any], dict[str, Any]]]:
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


def by_stage(outputs: list[Any], stage: str) -> list[dict[str, Any]]:
    return [o.payload for o in outputs if o.stage == stage]


class TinyOmni:
    """The seeded tiny checkpoint saved to `ckpt`, its transformers model, and the reference turns of
    `omni_cases()` (each computed once)."""

    def __init__(self, ckpt: Path) -> None:
        self.ckpt = ckpt
        self.model = save_reference(ckpt)
        self.cases = omni_cases()
        self.lookahead = lookahead_samples(Qwen3OmniConfig.from_json_file(ckpt).code2wav)
        """Samples our stream ends with beyond the reference's waveform (the decoder's last lookahead, which
        the reference trims)."""
        self._turns: dict[tuple[int, int, int], tuple[torch.Tensor, ...]] = {}

    def turn(self, case: int, max_new_tokens: int, max_frames: int) -> tuple[torch.Tensor, ...]:
        """The reference's (text ids [L], codes [G, T], waveform [N]) for `omni_cases()[case]`."""
        key = (case, max_new_tokens, max_frames)
        if key not in self._turns:
            text_ids, codes, wav = hf_turn(self.model, max_new_tokens, max_frames, **self.cases[case][1])
            self._turns[key] = (text_ids[0], codes[0], wav[0].reshape(-1))
        return self._turns[key]

    def check(self, case: int, max_new_tokens: int, max_frames: int, outputs: list[Any]) -> str:
        """`outputs` (one request's, every terminal stage's) stream what the reference generates: the thinker's
        text ids and the talker's codes exactly, the waveform within 1e-4; returns a one-line summary."""
        text_ids, codes, wav = self.turn(case, max_new_tokens, max_frames)
        prompt = self.cases[case][1]["input_ids"][0].tolist()
        thinker = by_stage(outputs, "thinker")
        assert all(not any(k.startswith("_") for k in p) for p in thinker), "the talker feed is not the client's"
        assert prompt + thinker[-1]["token_ids"] == text_ids.tolist()
        frames = [torch.tensor(np.array(p["codes"])) for p in by_stage(outputs, "talker") if "codes" in p]
        assert frames and torch.equal(torch.cat(frames, dim=1), codes)
        pcm = torch.cat([torch.tensor(np.array(p["pcm"])).reshape(-1) for p in by_stage(outputs, "code2wav")
                         if "pcm" in p])
        assert pcm.shape[0] == wav.shape[0] + self.lookahead
        err = (pcm[: wav.shape[0]] - wav).abs().max().item()
        assert err <= 1e-4, err
        assert wav.abs().max() > 1e-3
        return (f"prompt {len(prompt)} tokens: {len(thinker[-1]['token_ids'])} reply tokens, {codes.shape[-1]} "
                f"frames, {pcm.shape[0]} samples, max err {err:.1e}")
