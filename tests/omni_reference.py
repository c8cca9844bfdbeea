"""The transformers Qwen3-Omni reference on the tiny config: one seeded model and one greedy turn.

Shared by the model parity tests and the pipeline tests, so both compare against the same oracle.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import transformers

from voice_server.models.qwen3_omni.presets import TINY_IDS, tiny_config_dict


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
