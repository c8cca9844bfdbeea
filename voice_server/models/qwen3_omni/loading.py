"""Build one Qwen3-Omni part (thinker, talker, code2wav) from a checkpoint or as `load_format: dummy`.

Each serving stage loads only its own part: a stage never holds the other parts' weights. The
`audio_tower` part is the thinker's audio encoder alone (for the encoder stage), with the same
weights as inside the thinker: the checkpoint's `thinker.audio_tower.*`, or the same dummy draws.
The `vision` part is the thinker's vision tower alone (checkpoint `thinker.visual.*`); the thinker
itself does not build it and skips those weights, and its dummy draws are seeded by the names it
would have inside the thinker (`model.visual.*`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

import torch
from torch import nn

from voice_server.models.qwen3_omni.audio.encoder import AudioEncoder
from voice_server.models.qwen3_omni.code2wav.model import Code2Wav
from voice_server.models.qwen3_omni.config import Qwen3OmniConfig
from voice_server.models.qwen3_omni.talker.model import Talker
from voice_server.models.qwen3_omni.thinker.model import ThinkerModel
from voice_server.models.qwen3_omni.vision.encoder import VisionEncoder
from voice_server.models.qwen3_omni.weights import build_on_meta, init_dummy_weights, load_weights

Part = Literal["thinker", "talker", "code2wav", "audio_tower", "vision"]
# NOTE: where the towers sit in the thinker (in-memory names), for their checkpoint prefixes and dummy seeds.
_AUDIO_TOWER_PREFIX = "model.audio_tower."
_VISION_PREFIX = "model.visual."
LOAD_FORMATS = ("auto", "dummy")


def load_part(
    part: Part,
    cfg: Qwen3OmniConfig,
    ckpt_dir: str | Path | None = None,
    *,
    load_format: str = "auto",
    dtype: torch.dtype = torch.float32,
    device: str = "cpu",
    seed: int = 0,
) -> nn.Module:
    """`auto` reads `ckpt_dir` (released sharded layout or `save_pretrained` output), memory-mapped
    into a meta-built module; `dummy` draws seeded random weights of the right shapes."""
    if load_format not in LOAD_FORMATS:
        raise ValueError(f"load_format must be one of {', '.join(LOAD_FORMATS)}, got {load_format!r}")
    module = build_part_on_meta(part, cfg)
    ignore = ThinkerModel.IGNORED_STATE_PREFIXES if part == "thinker" else ()
    name_prefix = {"audio_tower": _AUDIO_TOWER_PREFIX, "vision": _VISION_PREFIX}.get(part, "")
    prefix = f"thinker.{name_prefix}" if name_prefix else f"{part}."
    if load_format == "dummy":
        init_dummy_weights(module, seed, dtype, device=device, name_prefix=name_prefix)
    else:
        if ckpt_dir is None:
            raise ValueError("load_format 'auto' needs a checkpoint directory")
        load_weights(module, Path(ckpt_dir), prefix, dtype, device=device, ignore_prefixes=ignore)
    return module.eval()


def build_part_on_meta(part: Part, cfg: Qwen3OmniConfig) -> nn.Module:
    """The part's modules with every parameter on the meta device: its shapes, without memory (what
    `load_part` fills, and what a memory plan counts)."""
    if part == "audio_tower":
        return build_on_meta(AudioEncoder, cfg.thinker.audio)
    if part == "vision":
        return build_on_meta(VisionEncoder, cfg.thinker.vision)
    if part == "thinker":
        return build_on_meta(ThinkerModel, cfg.thinker)
    if part == "talker":
        return build_on_meta(Talker, cfg.talker)
    if part == "code2wav":
        return build_on_meta(Code2Wav, cfg.code2wav)
    raise ValueError(f"part must be thinker, talker, code2wav, audio_tower or vision, got {part!r}")
