"""Checkpoint loading for Qwen3-Omni: the released Hugging Face layout -> our in-memory modules.

On disk (`Qwen/Qwen3-Omni-30B-A3B-Instruct`, or any `save_pretrained` output): sharded safetensors
with `model.safetensors.index.json` (or one `model.safetensors`), prefixes `thinker.`, `talker.`
(incl. `talker.code_predictor.`) and `code2wav.`, routed experts unfused
(`mlp.experts.N.{gate,up,down}_proj.weight`) and thinker names without transformers' in-memory
`model.language_model` / `model.audio_tower` / `model.visual` nesting.

In memory our modules use transformers' in-memory names (fused experts `experts.gate_up_proj
[E, 2I, H]` and `experts.down_proj [E, H, I]`). Modules are built with `build_on_meta` and then
filled tensor by tensor from memory-mapped shards, so peak RAM is the model plus one layer's experts.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import re
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, TypeVar

import torch
from safetensors import safe_open
from torch import nn

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"

_EXPERT = re.compile(r"^(?P<group>.+\.experts)\.(?P<idx>\d+)\.(?P<proj>gate_proj|up_proj|down_proj)\.weight$")
# transformers' conversion_mapping for Qwen2_5OmniThinkerForConditionalGeneration (Qwen3-Omni's thinker):
# the released checkpoint predates the language_model/audio_tower/visual nesting under `thinker.model.`.
_THINKER_RENAMES = (
    (re.compile(r"^thinker\.audio_tower\."), "thinker.model.audio_tower."),
    (re.compile(r"^thinker\.visual\."), "thinker.model.visual."),
    (re.compile(r"^thinker\.model\.(?!(language_model|visual|audio_tower)\.)"), "thinker.model.language_model."),
)

M = TypeVar("M", bound=nn.Module)
C = TypeVar("C")


def build_on_meta(cls: Callable[[C], M], cfg: C) -> M:
    """Construct `cls(cfg)` with every parameter on the meta device (no memory, no init cost) while
    buffers stay real, so values computed at construction (RoPE tables, offsets) survive loading."""
    # NOTE: the accelerate `init_empty_weights` trick: each parameter is moved to meta as it is
    # registered, before the module's own reset_parameters() runs (which is then a no-op on meta).
    original = nn.Module.register_parameter

    def register_on_meta(self: nn.Module, name: str, param: nn.Parameter | None) -> None:
        original(self, name, param)
        if param is not None and not param.is_meta:
            self._parameters[name] = nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)

    nn.Module.register_parameter = register_on_meta  # type: ignore[method-assign]
    try:
        return cls(cfg)
    finally:
        nn.Module.register_parameter = original  # type: ignore[method-assign]


def checkpoint_index(ckpt_dir: Path) -> dict[str, Path]:
    """On-disk tensor name -> shard file, from the index (sharded) or the single safetensors file."""
    ckpt_dir = Path(ckpt_dir)
    index = ckpt_dir / INDEX_FILE
    if index.exists():
        weight_map: dict[str, str] = json.loads(index.read_text())["weight_map"]
        return {name: ckpt_dir / shard for name, shard in weight_map.items()}
    single = ckpt_dir / SINGLE_FILE
    if single.exists():
        with safe_open(str(single), framework="pt") as fh:
            return dict.fromkeys(fh.keys(), single)
    raise FileNotFoundError(f"no {INDEX_FILE} or {SINGLE_FILE} in {ckpt_dir}")


def disk_to_memory_name(name: str) -> str:
    """Full on-disk tensor name -> full in-memory name (transformers' `Qwen3OmniMoeForConditionalGeneration`)."""
    for pattern, replacement in _THINKER_RENAMES:
        if pattern.match(name):
            return pattern.sub(replacement, name, count=1)
    return name


class _Shards:
    """Lazily opened, memory-mapped shard handles."""

    def __init__(self, stack: contextlib.ExitStack) -> None:
        self.stack = stack
        self.handles: dict[Path, Any] = {}

    def get(self, path: Path, name: str) -> torch.Tensor:
        if path not in self.handles:
            self.handles[path] = self.stack.enter_context(safe_open(str(path), framework="pt"))
        return self.handles[path].get_tensor(name)


def _set_tensor(module: nn.Module, name: str, value: torch.Tensor) -> None:
    mod_path, _, leaf = name.rpartition(".")
    owner = module.get_submodule(mod_path)
    if leaf in owner._parameters:
        old = owner._parameters[leaf]
        if old is not None and old.shape != value.shape:
            raise ValueError(f"shape mismatch for {name}: checkpoint {tuple(value.shape)}, "
                             f"module {tuple(old.shape)}")
        requires_grad = old.requires_grad if old is not None else False
        owner._parameters[leaf] = nn.Parameter(value, requires_grad=requires_grad)
    elif leaf in owner._buffers:
        old_buf = owner._buffers[leaf]
        if old_buf is not None and old_buf.shape != value.shape:
            raise ValueError(f"shape mismatch for buffer {name}: {tuple(value.shape)} vs {tuple(old_buf.shape)}")
        owner._buffers[leaf] = value
    else:
        raise KeyError(f"{name} is neither a parameter nor a buffer")


def _convert(t: torch.Tensor, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    return t.to(device=device, dtype=dtype if t.is_floating_point() else t.dtype)


def _check_materialised(module: nn.Module) -> None:
    left = [n for n, t in (*module.named_parameters(), *module.named_buffers()) if t.is_meta]
    if left:
        raise RuntimeError(f"{len(left)} tensors are still on the meta device (non-persistent buffers "
                           f"must be built by build_on_meta): {_names(left)}")


def _names(names: Sequence[str], limit: int = 20) -> str:
    shown = ", ".join(sorted(names)[:limit])
    return shown + (f", ... ({len(names) - limit} more)" if len(names) > limit else "")


def load_weights(
    module: nn.Module,
    ckpt_dir: Path,
    prefix: str,
    dtype: torch.dtype,
    *,
    device: torch.device | str = "cpu",
    ignore_prefixes: Sequence[str] = (),
) -> None:
    """Load every checkpoint tensor whose in-memory name starts with `prefix` into `module`, with the
    prefix stripped, e.g. "code2wav." -> Code2Wav, "talker." -> Talker, "thinker." -> the thinker,
    "thinker.model.audio_tower." -> an audio encoder alone. Names are converted to transformers'
    in-memory layout first (`disk_to_memory_name`); per-expert weights are fused into
    `experts.gate_up_proj` / `experts.down_proj` when the module has those, and loaded as they are
    otherwise. `module` may be built on meta (`build_on_meta`) or materialised.

    Floating tensors are cast to `dtype` on `device`. Module-relative names starting with one of
    `ignore_prefixes` are skipped (e.g. "model.visual." for a thinker without the vision tower). Any
    other missing or unexpected name raises a ValueError that lists them.
    """
    device = torch.device(device)
    expected = {n for n in module.state_dict() if not n.startswith(tuple(ignore_prefixes))}
    plain: dict[str, str] = {}
    experts: dict[str, dict[tuple[str, int], str]] = {}
    index = checkpoint_index(ckpt_dir)
    for disk_name in index:
        full_name = disk_to_memory_name(disk_name)
        if not full_name.startswith(prefix):
            continue
        name = full_name[len(prefix) :]
        match = _EXPERT.match(name)
        if match and f"{match['group']}.gate_up_proj" in expected:
            experts.setdefault(match["group"], {})[(match["proj"], int(match["idx"]))] = disk_name
        elif not name.startswith(tuple(ignore_prefixes)):
            plain[name] = disk_name
    provided = set(plain) | {f"{g}.{p}" for g in experts for p in ("gate_up_proj", "down_proj")}
    missing, unexpected = sorted(expected - provided), sorted(provided - expected)
    if missing or unexpected:
        raise ValueError(f"checkpoint {ckpt_dir} prefix {prefix!r} does not match {type(module).__name__}: "
                         f"missing keys [{_names(missing)}]; unexpected keys [{_names(unexpected)}]")
    with contextlib.ExitStack() as stack:
        shards = _Shards(stack)
        # NOTE: sorted by shard file so each shard is paged in once, in order.
        for name, disk_name in sorted(plain.items(), key=lambda kv: (str(index[kv[1]]), kv[1])):
            _set_tensor(module, name, _convert(shards.get(index[disk_name], disk_name), dtype, device))
        for group, sources in experts.items():
            for fused_name, tensor in _fuse_experts(group, sources, index, shards, dtype, device):
                _set_tensor(module, fused_name, tensor)
    _check_materialised(module)


def _fuse_experts(
    group: str,
    sources: dict[tuple[str, int], str],
    index: dict[str, Path],
    shards: _Shards,
    dtype: torch.dtype,
    device: torch.device,
) -> Iterator[tuple[str, torch.Tensor]]:
    """Per-expert weights of one layer -> gate_up_proj [E, 2I, H] (gate rows first) and down_proj
    [E, H, I], copied expert by expert into one preallocated tensor each."""
    num_experts = 1 + max(idx for _, idx in sources)
    for proj in ("gate_proj", "up_proj", "down_proj"):
        absent = [i for i in range(num_experts) if (proj, i) not in sources]
        if absent:
            raise ValueError(f"checkpoint misses {group}.{{{absent[:8]}}}.{proj}.weight")
    load = lambda proj, i: _convert(shards.get(index[sources[proj, i]], sources[proj, i]), dtype, device)
    gate0 = load("gate_proj", 0)
    inter, hidden = gate0.shape
    gate_up = torch.empty(num_experts, 2 * inter, hidden, dtype=gate0.dtype, device=device)
    for i in range(num_experts):
        gate_up[i, :inter] = gate0 if i == 0 else load("gate_proj", i)
        gate_up[i, inter:] = load("up_proj", i)
    yield f"{group}.gate_up_proj", gate_up
    down0 = load("down_proj", 0)
    down = torch.empty(num_experts, *down0.shape, dtype=down0.dtype, device=device)
    for i in range(num_experts):
        down[i] = down0 if i == 0 else load("down_proj", i)
    yield f"{group}.down_proj", down


# ---------------------------------------------------------------------------------------------
# load_format: dummy
# ---------------------------------------------------------------------------------------------


def _dummy_value(name: str, shape: torch.Size, g: torch.Generator, device: torch.device) -> torch.Tensor:
    r = torch.randn(shape, generator=g, device=device, dtype=torch.float32)
    if name.endswith((".alpha", ".beta")):  # SnakeBeta, log scale: frequencies/magnitudes near 1
        return 0.1 * r
    if name.endswith((".scale", ".gamma")):  # LayerScale / ConvNeXt gamma: well above their ~0 init
        return 0.1 + 0.02 * r
    if len(shape) == 1:
        return 1.0 + 0.02 * r if name.endswith(".weight") else 0.02 * r  # norm weights / biases
    if len(shape) >= 3 and ".experts." not in name:  # conv kernels: unit-gain fan-in scaling
        return 0.5 * r / float(torch.tensor(shape[1:]).prod()) ** 0.5
    # NOTE: in place (the same bits as `0.02 * r`): no second float32 copy of a GiB-sized expert tensor.
    return r.mul_(0.02)  # Linear, Embedding, fused experts, routers


@torch.no_grad()
def init_dummy_weights(
    module: nn.Module, seed: int, dtype: torch.dtype, *, device: torch.device | str = "cpu", name_prefix: str = ""
) -> None:
    """`load_format: dummy`: random weights of the right shapes, no checkpoint.

    Each tensor is drawn from its own generator seeded by (seed, name), so values are deterministic
    per seed and device and do not depend on which other modules exist. Scales: norm weights
    1 + N(0, 0.02), biases N(0, 0.02), Linear/Embedding/experts N(0, 0.02), conv kernels 0.5/sqrt(fan_in),
    SnakeBeta alpha/beta N(0, 0.1) (log scale), LayerScale/ConvNeXt gamma 0.1 + N(0, 0.02).
    Persistent buffers are left as built (they are recomputed state such as RoPE tables).
    `name_prefix` is put before each name when seeding, so a submodule built alone (e.g. the audio
    tower, "model.audio_tower.") draws the same values as inside its parent.
    """
    if not 0 <= seed < 2**31:
        raise ValueError(f"seed must be in [0, 2**31), got {seed}")
    device = torch.device(device)
    for name, param in module.named_parameters():
        # NOTE: a hash of (seed, name): the CPU generator keeps only the low 32 bits of its seed.
        digest = hashlib.sha256(f"{seed}/{name_prefix}{name}".encode()).digest()
        g = torch.Generator(device=device).manual_seed(int.from_bytes(digest[:8], "little") >> 1)
        _set_tensor(module, name, _dummy_value(name, param.shape, g, device).to(dtype))
    _check_materialised(module)

