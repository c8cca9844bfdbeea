"""Checkpoint loader: a tiny HF `save_pretrained` checkpoint (released on-disk layout: sharded, per-expert
weights, unnested thinker names) loads bitwise into our modules and into HF's in-memory layout."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from torch import nn

from voice_server.models.qwen3_omni.code2wav.config import Code2WavConfig
from voice_server.models.qwen3_omni.code2wav.model import Code2Wav
from voice_server.models.qwen3_omni.config import Qwen3OmniConfig
from voice_server.models.qwen3_omni.presets import tiny_config_dict
from voice_server.models.qwen3_omni.talker.model import Talker
from voice_server.models.qwen3_omni.thinker.model import ThinkerModel
from voice_server.models.qwen3_omni.weights import INDEX_FILE, build_on_meta, init_dummy_weights, load_weights

torch.set_num_threads(1)


@torch.no_grad()
def randomize_(model: nn.Module, seed: int) -> None:
    # HF leaves the talker's routed experts uninitialised (torch.empty) and many params near-trivial.
    g = torch.Generator().manual_seed(seed)
    for _, p in sorted(model.named_parameters()):
        p.copy_(0.1 * torch.randn(p.shape, generator=g))


@pytest.fixture(scope="module")
def hf_model() -> nn.Module:
    from transformers import Qwen3OmniMoeConfig, Qwen3OmniMoeForConditionalGeneration

    model = Qwen3OmniMoeForConditionalGeneration(Qwen3OmniMoeConfig(**tiny_config_dict())).eval()
    randomize_(model, seed=0)
    return model


@pytest.fixture(scope="module")
def ckpt(hf_model: nn.Module, tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("tiny_omni")
    hf_model.save_pretrained(path, max_shard_size="40KB")  # type: ignore[operator]
    return path


def assert_bitwise(ours: dict[str, torch.Tensor], ref: dict[str, torch.Tensor], dtype: torch.dtype) -> None:
    assert set(ours) == set(ref)
    for name, tensor in ref.items():
        assert ours[name].dtype == (dtype if tensor.is_floating_point() else tensor.dtype), name
        assert torch.equal(ours[name], tensor.to(ours[name].dtype)), name


def test_checkpoint_is_released_layout(ckpt: Path) -> None:
    weight_map = json.loads((ckpt / INDEX_FILE).read_text())["weight_map"]
    assert len(set(weight_map.values())) > 3
    assert "thinker.model.layers.0.mlp.experts.3.up_proj.weight" in weight_map
    assert "talker.model.layers.1.mlp.experts.0.down_proj.weight" in weight_map
    assert "thinker.audio_tower.conv2d1.weight" in weight_map
    assert any(k.startswith("code2wav.decoder.") for k in weight_map)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_code2wav_loads_bitwise(hf_model: nn.Module, ckpt: Path, dtype: torch.dtype) -> None:
    cfg = Code2WavConfig.from_hf_dict(tiny_config_dict()["code2wav_config"])
    model = build_on_meta(Code2Wav, cfg)
    load_weights(model, ckpt, "code2wav.", dtype)
    ref = hf_model.code2wav  # type: ignore[union-attr]
    assert_bitwise(model.state_dict(), ref.state_dict(), dtype)
    if dtype == torch.float32:
        codes = torch.randint(0, cfg.codebook_size, (1, cfg.num_quantizers, 30))
        with torch.no_grad():
            assert (model(codes) - ref(codes)).abs().max() <= 1e-4


@pytest.mark.parametrize("part", ["thinker", "talker"])
def test_hf_in_memory_layout_roundtrip(hf_model: nn.Module, ckpt: Path, part: str) -> None:
    # Renames (thinker.model.* -> model.language_model.*, audio_tower/visual nesting) and expert fusion
    # checked against transformers' own in-memory layout, independent of our thinker/talker modules.
    ref = getattr(hf_model, part)
    model = build_on_meta(type(ref), ref.config)
    load_weights(model, ckpt, f"{part}.", torch.float32)
    sd = model.state_dict()
    assert_bitwise(sd, ref.state_dict(), torch.float32)
    fused = "model.language_model.layers.0.mlp.experts.gate_up_proj" if part == "thinker" else \
        "model.layers.0.mlp.experts.gate_up_proj"
    assert sd[fused].shape[0] == 4


def test_single_file_checkpoint(hf_model: nn.Module, tmp_path: Path) -> None:
    hf_model.code2wav.save_pretrained(tmp_path)  # type: ignore[union-attr, operator]
    assert (tmp_path / "model.safetensors").exists() and not (tmp_path / INDEX_FILE).exists()
    model = build_on_meta(Code2Wav, Code2WavConfig.from_hf_dict(tiny_config_dict()["code2wav_config"]))
    load_weights(model, tmp_path, "", torch.float32)
    assert_bitwise(model.state_dict(), hf_model.code2wav.state_dict(), torch.float32)  # type: ignore[union-attr]


def test_missing_and_unexpected_keys_are_named(ckpt: Path) -> None:
    d = tiny_config_dict()["code2wav_config"]
    deeper = build_on_meta(Code2Wav, Code2WavConfig.from_hf_dict({**d, "num_hidden_layers": 2}))
    with pytest.raises(ValueError, match=r"missing keys \[.*pre_transformer\.layers\.1\.input_layernorm\.weight"):
        load_weights(deeper, ckpt, "code2wav.", torch.float32)
    no_norm = build_on_meta(Code2Wav, Code2WavConfig.from_hf_dict(d))
    del no_norm.pre_transformer.norm
    with pytest.raises(ValueError, match=r"unexpected keys \[pre_transformer\.norm\.weight\]"):
        load_weights(no_norm, ckpt, "code2wav.", torch.float32)
    wider = build_on_meta(Code2Wav, Code2WavConfig.from_hf_dict({**d, "intermediate_size": 48}))
    with pytest.raises(ValueError, match="shape mismatch for pre_transformer.layers.0.mlp"):
        load_weights(wider, ckpt, "code2wav.", torch.float32)


def test_meta_buffers_must_come_from_build_on_meta(hf_model: nn.Module, ckpt: Path) -> None:
    ref = hf_model.code2wav  # type: ignore[union-attr]
    with torch.device("meta"):
        plain_meta = type(ref)(ref.config)  # non-persistent buffers (code_offset, inv_freq) on meta
    with pytest.raises(RuntimeError, match="code_offset"):
        load_weights(plain_meta, ckpt, "code2wav.", torch.float32)
    built = build_on_meta(type(ref), ref.config)
    assert all(p.is_meta for p in built.parameters()) and not any(b.is_meta for b in built.buffers())


def test_dummy_weights_deterministic_and_sensible() -> None:
    cfg = Code2WavConfig.from_hf_dict(tiny_config_dict()["code2wav_config"])

    def dummy(seed: int, dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
        with torch.device("meta"):
            model = Code2Wav(cfg)
        init_dummy_weights(model, seed, dtype)
        return model.state_dict()

    a, b, c = dummy(7), dummy(7), dummy(8)
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert all(not torch.equal(a[k], c[k]) for k in a)
    assert all(t.dtype == torch.bfloat16 for t in dummy(7, torch.bfloat16).values())
    norm = a["pre_transformer.norm.weight"]
    assert (norm - 1).abs().max() < 0.2 and norm.std() > 0
    assert 0.005 < a["pre_transformer.layers.0.mlp.gate_proj.weight"].std() < 0.04
    for name in ("pre_transformer.layers.0.self_attn_layer_scale.scale", "upsample.0.1.gamma",
                 "decoder.1.block.0.alpha", "decoder.1.block.2.act1.beta"):
        assert a[name].abs().mean() > 0.05, name  # HF init leaves these at 0.01, 1e-6, 0, 0
    # Each tensor's draw depends only on (seed, name): a bigger model shares the common tensors.
    with torch.device("meta"):
        bigger = Code2Wav(Code2WavConfig.from_hf_dict({**tiny_config_dict()["code2wav_config"],
                                                       "num_hidden_layers": 2}))
    init_dummy_weights(bigger, 7, torch.float32)
    assert torch.equal(bigger.state_dict()["code_embedding.weight"], a["code_embedding.weight"])


@pytest.mark.parametrize("part", ["thinker", "talker"])
def test_our_thinker_and_talker_load_bitwise(hf_model: nn.Module, ckpt: Path, part: str) -> None:
    cfg = Qwen3OmniConfig.from_hf_dict(tiny_config_dict())
    model: nn.Module = build_on_meta(ThinkerModel, cfg.thinker) if part == "thinker" else \
        build_on_meta(Talker, cfg.talker)
    # NOTE: our thinker has no vision tower; its checkpoint tensors are skipped by name.
    load_weights(model, ckpt, f"{part}.", torch.float32, ignore_prefixes=("model.visual.",))
    ref = {k: v for k, v in getattr(hf_model, part).state_dict().items() if not k.startswith("model.visual.")}
    assert_bitwise(model.state_dict(), ref, torch.float32)


def test_unfused_module_and_sub_prefix(hf_model: nn.Module, ckpt: Path) -> None:
    from safetensors import safe_open

    from voice_server.models.qwen3_omni.weights import checkpoint_index

    # A module that keeps the per-expert layout gets the tensors as stored (fusion is optional).
    index = {k: v for k, v in checkpoint_index(ckpt).items() if k.startswith("talker.")}
    raw = {}
    for name, path in index.items():
        with safe_open(str(path), framework="pt") as fh:
            raw[name[len("talker.") :]] = fh.get_tensor(name)
    mirror = nn.Module()
    for name, tensor in raw.items():
        *path, leaf = name.split(".")
        owner = mirror
        for part in path:
            if not hasattr(owner, part):
                owner.add_module(part, nn.Module())
            owner = getattr(owner, part)
        owner.register_parameter(leaf, nn.Parameter(torch.empty(tensor.shape, device="meta")))
    assert "model.layers.0.mlp.experts.3.gate_proj.weight" in raw
    load_weights(mirror, ckpt, "talker.", torch.float32)
    assert_bitwise(mirror.state_dict(), raw, torch.float32)
    # A prefix in in-memory naming selects one submodule, e.g. the thinker's audio encoder alone.
    ref = hf_model.thinker.model.audio_tower  # type: ignore[union-attr]
    tower = build_on_meta(type(ref), ref.config)
    load_weights(tower, ckpt, "thinker.model.audio_tower.", torch.float32)
    assert_bitwise(tower.state_dict(), ref.state_dict(), torch.float32)


def test_audio_tower_part_loads_alone(hf_model: nn.Module, ckpt: Path) -> None:
    from voice_server.models.qwen3_omni.loading import load_part

    # The encoder stage's part: only `thinker.audio_tower.*` from the checkpoint, and in dummy mode the
    # same draws as the tower inside a dummy thinker (the seeds hash the thinker's names).
    cfg = Qwen3OmniConfig.from_hf_dict(tiny_config_dict())
    tower = load_part("audio_tower", cfg, ckpt)
    assert_bitwise(tower.state_dict(), hf_model.thinker.model.audio_tower.state_dict(), torch.float32)
    dummy = load_part("audio_tower", cfg, load_format="dummy", seed=5).state_dict()
    inside = load_part("thinker", cfg, load_format="dummy", seed=5).model.audio_tower.state_dict()  # type: ignore[union-attr]
    assert dummy.keys() == inside.keys() and all(torch.equal(dummy[k], inside[k]) for k in dummy)
