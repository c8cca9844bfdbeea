"""The one reader of the factory_args every Qwen3-Omni stage shares, and the part loader behind them.

factory_args common to the encoder, thinker, talker and code2wav stages:
- `checkpoint`: a checkpoint directory (config.json + safetensors, the released layout or a
  `save_pretrained` output). Each stage loads only its own part's weights.
- `preset` instead of a checkpoint: seeded dummy weights (`seed`, default 0) of `tiny` (the tiny test
  config) or `released` (the released Qwen3-Omni-30B-A3B sizes, `Qwen3OmniConfig()`: for timing and
  memory checks on a GPU without the checkpoint; ~66 GiB in bf16 over the four parts). Stages given
  the same preset and seed hold the same weights.
- `dtype`: `fp32` (default on CPU) or `bf16` (default on CUDA).
- `num_threads` (null: torch's default): intra-op threads of the stage's process.

A stage module reads its own extra keys after these (`OmniArgs.extra`), so one typo check covers all.
`check_args` reads them for a memory plan (`stage_memory`, `voice_server/config/budget.py`) without
building the stage, and `part_weight_bytes` counts a part's weights on the meta device.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from voice_server.config import PipelineConfig, StageConfig
from voice_server.config.errors import fail, quoted, show
from voice_server.config.fields import Flag, Number, read_arg
from voice_server.engine.runtime import StageContext
from voice_server.models.qwen3_omni.config import Qwen3OmniConfig
from voice_server.models.qwen3_omni.loading import Part, build_part_on_meta, load_part
from voice_server.models.qwen3_omni.presets import tiny_config_dict

COMMON_ARGS = ("checkpoint", "preset", "seed", "dtype", "num_threads")
PRESETS = ("tiny", "tiny-full-rate", "released")
_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


@dataclass(frozen=True)
class OmniArgs:
    where: str
    """`stage 'name'`, for errors that name the field."""
    cfg: Qwen3OmniConfig
    checkpoint: Path | None
    seed: int
    dtype: torch.dtype
    device: str
    extra: dict[str, Any] = field(default_factory=dict)
    """The stage's own keys (already checked against its list of known keys)."""

    def load(self, part: Part) -> nn.Module:
        """This stage's part: the checkpoint's weights, or the preset's seeded dummy weights."""
        load_format = "dummy" if self.checkpoint is None else "auto"
        module = load_part(part, self.cfg, self.checkpoint, load_format=load_format, dtype=self.dtype,
                           device=self.device, seed=self.seed)
        if self.device.startswith("cuda"):
            # NOTE: loading leaves float32 draws and staging copies in torch's cache; give them back
            # to the driver so stages sharing the GPU can have them (the KV cache is sized next).
            torch.cuda.empty_cache()
        return module

    def part_weight_bytes(self, part: Part) -> int:
        """Bytes `load(part)` will hold: its parameters at the stage's dtype (counted on the meta device)."""
        return sum(p.numel() for p in build_part_on_meta(part, self.cfg).parameters()) * self.dtype.itemsize

    def flag_arg(self, key: str, default: bool) -> bool:
        return bool(read_arg(self.where, self.extra, key, Flag(), default))

    def int_arg(self, key: str, default: int | None, minimum: int) -> int | None:
        rule = Number(int, minimum=minimum, is_nullable=True)  # NOTE: null: the default
        value: int | None = read_arg(self.where, self.extra, key, rule, default)
        return default if value is None else value


def preset_config(preset: str) -> Qwen3OmniConfig:
    """The model config of a `preset` (one of PRESETS); builds no weights."""
    if preset == "released":
        # NOTE: the defaults are the released 30B-A3B sizes and ids (`models/qwen3_omni/config.py`).
        return Qwen3OmniConfig()
    return Qwen3OmniConfig.from_hf_dict(tiny_config_dict(is_full_rate=preset == "tiny-full-rate"),
                                        where=f"preset {preset}")


def read_omni_args(ctx: StageContext, own_keys: tuple[str, ...] = ()) -> OmniArgs:
    """Check the common keys (and that no unknown key is given), set the thread count, read the config."""
    stage = ctx.stage
    where = f"stage {quoted(stage.name)}"
    args = ctx.known_args(COMMON_ARGS + own_keys)
    checkpoint, preset = args.get("checkpoint"), args.get("preset")
    if (checkpoint is None) == (preset is None):
        raise fail(where, "factory_args.checkpoint", "give exactly one of `checkpoint` (a directory) and `preset`")
    seed = args.get("seed", 0)
    if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
        raise fail(where, "factory_args.seed", f"must be an integer >= 0, got {show(seed)}")
    dtype_name = args.get("dtype", "fp32" if stage.device == "cpu" else "bf16")
    if dtype_name not in _DTYPES:
        raise fail(where, "factory_args.dtype", f"must be one of {', '.join(_DTYPES)}, got {show(dtype_name)}")
    num_threads = args.get("num_threads")
    if num_threads is not None:
        if isinstance(num_threads, bool) or not isinstance(num_threads, int) or num_threads < 1:
            raise fail(where, "factory_args.num_threads", f"must be null or an integer >= 1, got {show(num_threads)}")
        torch.set_num_threads(num_threads)
    path: Path | None = None
    if preset is not None:
        if preset not in PRESETS:
            raise fail(where, "factory_args.preset", f"must be one of {', '.join(PRESETS)}, got {show(preset)}")
        cfg = preset_config(preset)
    else:
        if not isinstance(checkpoint, str) or not Path(checkpoint).expanduser().is_dir():
            raise fail(where, "factory_args.checkpoint", f"must be a checkpoint directory, got {show(checkpoint)}")
        path = Path(checkpoint).expanduser()
        try:
            cfg = Qwen3OmniConfig.from_json_file(path)
        except (OSError, ValueError) as exc:
            raise fail(where, "factory_args.checkpoint", str(exc)) from exc
    extra = {k: v for k, v in args.items() if k not in COMMON_ARGS}
    return OmniArgs(where, cfg, path, seed, _DTYPES[dtype_name], stage.device, extra)


def check_args(stage: StageConfig, pipeline: PipelineConfig, own_keys: tuple[str, ...] = ()) -> OmniArgs:
    """`read_omni_args` for a memory plan: the stage is not built (its budget is the launch's business)."""
    return read_omni_args(StageContext(stage, pipeline, None, "check-config"), own_keys)
