"""Vision tower vs transformers' Qwen3OmniMoeVisionEncoder (the thinker's `visual`), random fp32.

Outputs (`pooler_output`, the merged thinker embeds) and every DeepStack feature within 1e-5 of the
reference, on the tiny preset's tower and on configs with a 2x2 merge, deeper towers and the released
head size and position table; images, several grids in one call, videos (t > 1) and odd merged grids.
Then `load_part("vision")` from a tiny `save_pretrained` checkpoint (`thinker.visual.*`) and as dummy.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers.models.qwen3_omni_moe.configuration_qwen3_omni_moe import Qwen3OmniMoeVisionEncoderConfig
from transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe import Qwen3OmniMoeVisionEncoder

from voice_server.models.qwen3_omni.config import Qwen3OmniConfig
from voice_server.models.qwen3_omni.loading import load_part
from voice_server.models.qwen3_omni.presets import tiny_config_dict
from voice_server.models.qwen3_omni.vision.config import VisionEncoderConfig
from voice_server.models.qwen3_omni.vision.encoder import VisionEncoder
from voice_server.models.qwen3_omni.weights import INDEX_FILE, build_on_meta, init_dummy_weights

torch.set_num_threads(1)

ATOL = 1e-5
CONFIGS: dict[str, dict[str, Any]] = {
    "tiny": tiny_config_dict()["thinker_config"]["vision_config"],  # merge 1, one block, DeepStack [0]
    "merge2": dict(
        depth=3, hidden_size=32, intermediate_size=48, num_heads=2, patch_size=4, temporal_patch_size=2,
        spatial_merge_size=2, out_hidden_size=24, deepstack_visual_indexes=[0, 2], num_position_embeddings=36,
    ),
    # DeepStack taps listed out of order: features still come in block order, each from its own merger.
    "unsorted_gelu": dict(
        depth=3, hidden_size=32, intermediate_size=48, num_heads=4, patch_size=4, temporal_patch_size=1,
        spatial_merge_size=2, out_hidden_size=24, deepstack_visual_indexes=[2, 0], num_position_embeddings=49,
        hidden_act="gelu", rope_parameters={"rope_type": "axial", "rope_theta": 500.0},
    ),
    # The released head_dim (72), patch (16 x 16 x 2 frames) and 48 x 48 position table, 6 blocks.
    "released_heads": dict(
        depth=6, hidden_size=144, intermediate_size=288, num_heads=2, patch_size=16, temporal_patch_size=2,
        spatial_merge_size=2, out_hidden_size=96, deepstack_visual_indexes=[1, 3, 5], num_position_embeddings=2304,
    ),
    # Wider and deeper: 8 blocks of 288 (head_dim 72), 14 x 14 patches, a 24 x 24 table.
    "wide": dict(
        depth=8, hidden_size=288, intermediate_size=1152, num_heads=4, patch_size=14, temporal_patch_size=2,
        spatial_merge_size=2, out_hidden_size=192, deepstack_visual_indexes=[2, 5, 7], num_position_embeddings=576,
    ),
}


@torch.no_grad()
def randomize_(model: torch.nn.Module, seed: int) -> None:
    # NOTE: unit-gain matrices and O(1) positions keep activations O(1) through the blocks, so an
    # absolute 1e-5 is a tight bound (HF init is N(0, 0.02): outputs near zero, any check passes).
    g = torch.Generator().manual_seed(seed)
    for name, p in sorted(model.named_parameters()):
        r = torch.randn(p.shape, generator=g)
        if name == "pos_embed.weight":
            p.copy_(0.5 * r)
        elif p.ndim == 1:
            p.copy_(1.0 + 0.1 * r if name.endswith(("norm1.weight", "norm2.weight", "ln_q.weight")) else 0.1 * r)
        else:
            p.copy_(r / p[0].numel() ** 0.5)


def make_pair(name: str, seed: int, attn: str = "sdpa") -> tuple[VisionEncoder, Qwen3OmniMoeVisionEncoder]:
    hf_cfg = Qwen3OmniMoeVisionEncoderConfig(**CONFIGS[name])
    hf_cfg._attn_implementation = attn
    ref = Qwen3OmniMoeVisionEncoder(hf_cfg).eval()
    randomize_(ref, seed)
    ours = VisionEncoder(VisionEncoderConfig.from_hf_dict(CONFIGS[name])).eval()
    ours.load_state_dict(ref.state_dict(), strict=True)
    return ours, ref


def pixels(cfg: VisionEncoderConfig, grids: list[tuple[int, int, int]], seed: int) -> torch.Tensor:
    num_patches = sum(t * h * w for t, h, w in grids)
    return torch.randn(num_patches, cfg.patch_dim, generator=torch.Generator().manual_seed(seed))


@torch.no_grad()
def max_errors(name: str, grids: list[tuple[int, int, int]], seed: int, attn: str = "sdpa") -> list[float]:
    """Max abs error of the embeds, then of each DeepStack feature (shapes and counts checked)."""
    ours, ref = make_pair(name, seed, attn)
    x, grid_thw = pixels(ours.cfg, grids, seed + 1), torch.tensor(grids)
    expected = ref(x, grid_thw=grid_thw)
    got = ours(x, grid_thw)
    num_tokens = sum(ours.num_tokens(grid_thw))
    assert got.embeds.shape == expected.pooler_output.shape == (num_tokens, ours.cfg.out_hidden_size)
    assert len(got.deepstack) == len(expected.deepstack_features) == len(ours.cfg.deepstack_visual_indexes)
    pairs = [(got.embeds, expected.pooler_output), *zip(got.deepstack, expected.deepstack_features)]
    assert all(a.shape == b.shape for a, b in pairs)
    assert expected.pooler_output.abs().max() > 0.1  # not a trivially small comparison
    return [(a - b).abs().max().item() for a, b in pairs]


@pytest.mark.parametrize(
    ("name", "grids", "seed"),
    [
        ("tiny", [(1, 4, 6)], 0),  # one image
        ("tiny", [(1, 1, 5), (1, 3, 1), (2, 2, 2)], 1),  # a 1-patch axis (interpolation divides by max(h-1, 1))
        ("merge2", [(1, 4, 6)], 2),
        ("merge2", [(1, 4, 4), (1, 8, 6), (1, 2, 10)], 3),  # several images of different grids in one call
        ("merge2", [(3, 4, 6)], 4),  # a video: attention per frame, positions repeated per frame
        ("merge2", [(2, 6, 4), (1, 4, 8), (4, 2, 2)], 5),  # videos and an image together
        ("merge2", [(1, 4, 12), (1, 20, 8)], 6),  # 2 x 6 and 10 x 4 merged tokens (grids wider than the table)
        ("unsorted_gelu", [(1, 6, 10), (2, 4, 4)], 7),
        ("released_heads", [(1, 16, 20), (2, 8, 12)], 8),  # 512 patches, table downsampled
        ("released_heads", [(1, 30, 6), (1, 2, 2), (3, 6, 4)], 9),
        ("wide", [(1, 32, 32), (2, 16, 12)], 15),  # 1,408 patches
    ],
)
def test_outputs_and_deepstack_match_hf(name: str, grids: list[tuple[int, int, int]], seed: int) -> None:
    errors = max_errors(name, grids, seed)
    assert max(errors) <= ATOL, errors


def test_matches_hf_eager_attention() -> None:
    errors = max_errors("merge2", [(1, 4, 6), (2, 2, 4)], seed=10, attn="eager")
    assert max(errors) <= ATOL, errors


@torch.no_grad()
def test_items_are_independent_within_a_call() -> None:
    # Attention never crosses frames and every index is per item: a packed call equals one call per item.
    ours, _ = make_pair("merge2", seed=11)
    grids = [(1, 4, 6), (3, 2, 4), (1, 10, 2)]
    x, grid_thw = pixels(ours.cfg, grids, seed=12), torch.tensor(grids)
    packed = ours(x, grid_thw)
    patch_splits, token_splits = [t * h * w for t, h, w in grids], ours.num_tokens(grid_thw)
    for i, (xi, grid) in enumerate(zip(x.split(patch_splits), grids)):
        alone = ours(xi, torch.tensor([grid]))
        assert (alone.embeds - packed.embeds.split(token_splits)[i]).abs().max() <= 1e-6
        for a, b in zip(alone.deepstack, packed.deepstack):
            assert (a - b.split(token_splits)[i]).abs().max() <= 1e-6


@torch.no_grad()
def test_bf16_follows_the_reference() -> None:
    # Rotary and position resampling run in fp32 as in the reference; the rest is bf16 rounding.
    ours, ref_model = make_pair("merge2", seed=13)
    ref: Any = ref_model  # NOTE: transformers' `to` is typed for dtype-less calls
    grids = [(1, 4, 6), (2, 4, 4)]
    x, grid_thw = pixels(ours.cfg, grids, seed=14), torch.tensor(grids)
    full = ours(x, grid_thw).embeds
    got = ours.to(torch.bfloat16)(x.to(torch.bfloat16), grid_thw)
    expected = ref.to(torch.bfloat16)(x.to(torch.bfloat16), grid_thw=grid_thw).pooler_output
    assert got.embeds.dtype == torch.bfloat16 and all(f.dtype == torch.bfloat16 for f in got.deepstack)
    scale = full.abs().max().item()
    assert (got.embeds.float() - full).abs().max().item() <= 0.05 * scale
    assert (got.embeds.float() - expected.float()).abs().max().item() <= 0.05 * scale


def test_bad_inputs_are_rejected() -> None:
    ours, _ = make_pair("merge2", seed=0)
    x = pixels(ours.cfg, [(1, 4, 6)], seed=0)
    with pytest.raises(ValueError, match="spatial_merge_size=2"):
        ours(x, torch.tensor([[1, 3, 8]]))
    with pytest.raises(ValueError, match="grid_thw implies 48"):
        ours(x, torch.tensor([[2, 4, 6]]))
    with pytest.raises(ValueError, match="pixel_values"):
        ours(x[:, :-1], torch.tensor([[1, 4, 6]]))


def test_release_size_on_meta_matches_hf_names_and_shapes() -> None:
    with torch.device("meta"):
        ours = VisionEncoder(VisionEncoderConfig())
        ref = Qwen3OmniMoeVisionEncoder(Qwen3OmniMoeVisionEncoderConfig(out_hidden_size=2048))
    assert list(ours.buffers()) == []
    assert {n: p.shape for n, p in ours.named_parameters()} == {n: p.shape for n, p in ref.named_parameters()}
    # The released thinker's 31,719,205,488 parameters (reference notes) minus the thinker without vision.
    assert sum(p.numel() for p in ours.parameters()) == 31_719_205_488 - 31_180_574_080 == 538_631_408


# ---------------------------------------------------------------------------------------------
# load_part("vision"): the checkpoint's `thinker.visual.*`, or seeded dummy weights
# ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def hf_model() -> Any:
    from transformers import Qwen3OmniMoeConfig, Qwen3OmniMoeForConditionalGeneration

    model = Qwen3OmniMoeForConditionalGeneration(Qwen3OmniMoeConfig(**tiny_config_dict())).eval()
    randomize_(model.thinker.model.visual, seed=20)
    return model


@pytest.fixture(scope="module")
def ckpt(hf_model: Any, tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("tiny_omni_vision")
    hf_model.save_pretrained(path, max_shard_size="40KB")
    return path


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_checkpoint_loads_thinker_visual_exactly(hf_model: Any, ckpt: Path, dtype: torch.dtype) -> None:
    weight_map = json.loads((ckpt / INDEX_FILE).read_text())["weight_map"]
    assert "thinker.visual.patch_embed.proj.weight" in weight_map  # the released on-disk name (no `model.`)
    assert "thinker.visual.merger_list.0.mlp.2.bias" in weight_map
    cfg = Qwen3OmniConfig.from_hf_dict(tiny_config_dict())
    tower = load_part("vision", cfg, ckpt, dtype=dtype)
    ref = hf_model.thinker.model.visual
    ours_sd, ref_sd = tower.state_dict(), ref.state_dict()
    assert ours_sd.keys() == ref_sd.keys()
    assert all(ours_sd[k].dtype == dtype and torch.equal(ours_sd[k], ref_sd[k].to(dtype)) for k in ref_sd)
    if dtype == torch.float32:
        grids = torch.tensor([[1, 4, 6], [2, 2, 3]])
        x = pixels(cfg.thinker.vision, [(1, 4, 6), (2, 2, 3)], seed=21)
        with torch.no_grad():
            got, expected = tower(x, grids), ref(x, grid_thw=grids)
        assert (got.embeds - expected.pooler_output).abs().max() <= ATOL
        assert (got.deepstack[0] - expected.deepstack_features[0]).abs().max() <= ATOL
    # The thinker part still skips the tower's tensors in the same checkpoint.
    thinker = load_part("thinker", cfg, ckpt, dtype=dtype)
    assert not any(name.startswith("model.visual.") for name in thinker.state_dict())


def test_dummy_vision_part_is_seeded_like_inside_the_thinker(hf_model: Any) -> None:
    cfg = Qwen3OmniConfig.from_hf_dict(tiny_config_dict())
    tower = load_part("vision", cfg, load_format="dummy", seed=5)
    ref_shapes = {n: t.shape for n, t in hf_model.thinker.model.visual.state_dict().items()}
    assert {n: t.shape for n, t in tower.state_dict().items()} == ref_shapes
    # Drawn by the names the tower has inside the thinker (`model.visual.*`), as the audio tower's are.
    holder, visual = torch.nn.Module(), build_on_meta(VisionEncoder, cfg.thinker.vision)
    holder.model = torch.nn.Module()
    holder.model.add_module("visual", visual)
    init_dummy_weights(holder, 5, torch.float32)
    inside, alone = visual.state_dict(), tower.state_dict()
    assert all(torch.equal(alone[k], inside[k]) for k in inside)
    other = load_part("vision", cfg, load_format="dummy", seed=6).state_dict()
    assert not any(torch.equal(alone[k], other[k]) for k in alone)
    with torch.no_grad():
        out = tower(pixels(cfg.thinker.vision, [(2, 4, 4)], seed=22), torch.tensor([[2, 4, 4]]))
    assert out.embeds.shape == (32, cfg.thinker.text.hidden_size) and torch.isfinite(out.embeds).all()
    assert out.embeds.std() > 0.01
