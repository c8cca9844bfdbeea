"""Vision tower config: released defaults, what transformers reads from `vision_config`, field errors."""

from __future__ import annotations

import json
from typing import Any

import pytest

from voice_server.models.qwen3_omni.config import Qwen3OmniConfig
from voice_server.models.qwen3_omni.presets import tiny_config_dict
from voice_server.models.qwen3_omni.thinker.config import ThinkerConfig
from voice_server.models.qwen3_omni.vision.config import VisionEncoderConfig

# The released `thinker_config.vision_config` values (see vision/config.py for the sources).
RELEASED_VISION = {
    "depth": 27, "hidden_size": 1152, "intermediate_size": 4304, "num_heads": 16, "hidden_act": "gelu_pytorch_tanh",
    "in_channels": 3, "patch_size": 16, "temporal_patch_size": 2, "spatial_merge_size": 2, "out_hidden_size": 2048,
    "num_position_embeddings": 2304, "deepstack_visual_indexes": [8, 16, 24],
}


def test_defaults_are_the_release() -> None:
    cfg = VisionEncoderConfig()
    assert cfg == VisionEncoderConfig.from_hf_dict(RELEASED_VISION) == VisionEncoderConfig.from_hf_dict({})
    assert Qwen3OmniConfig().thinker.vision == cfg == Qwen3OmniConfig.from_hf_dict({}).thinker.vision
    assert (cfg.head_dim, cfg.patch_dim, cfg.merged_hidden_size, cfg.num_grid_per_side) == (72, 1536, 4608, 48)
    assert cfg.rope_theta == 10000.0


def test_release_differs_from_transformers_class_defaults() -> None:
    import transformers

    hf: Any = transformers.Qwen3OmniMoeThinkerConfig().vision_config
    assert hf.out_hidden_size == 3584 and VisionEncoderConfig().out_hidden_size == 2048


def test_tiny_preset_and_its_saved_config_parse_like_transformers() -> None:
    import transformers

    d = tiny_config_dict()
    full: Any = transformers.Qwen3OmniMoeConfig(**d)
    hf = full.thinker_config.vision_config
    ours = Qwen3OmniConfig.from_hf_dict(d).thinker.vision
    # transformers writes every field, `rope_parameters` with type "axial" included.
    saved = json.loads(hf.to_json_string())
    assert saved["rope_parameters"]["rope_type"] == "axial"
    assert VisionEncoderConfig.from_hf_dict(saved) == ours
    for name in ("depth", "hidden_size", "intermediate_size", "num_heads", "hidden_act", "in_channels", "patch_size",
                 "temporal_patch_size", "spatial_merge_size", "out_hidden_size", "num_position_embeddings"):
        assert getattr(ours, name) == getattr(hf, name), name
    assert list(ours.deepstack_visual_indexes) == list(hf.deepstack_visual_indexes)
    assert ours.rope_theta == hf.rope_parameters["rope_theta"]


@pytest.mark.parametrize(
    "rope",
    [{"rope_parameters": {"rope_type": "axial", "rope_theta": 500.0}}, {"rope_theta": 500.0},
     {"rope_scaling": {"type": "default", "rope_theta": 500.0}}],
)
def test_rope_theta_spellings(rope: dict) -> None:
    assert VisionEncoderConfig.from_hf_dict(rope).rope_theta == 500.0


@pytest.mark.parametrize(
    ("d", "field_name"),
    [
        ({"hidden_size": 1152, "num_heads": 5}, "num_heads"),
        ({"hidden_size": 36, "num_heads": 2}, "multiple of 4"),  # head_dim 18
        ({"num_position_embeddings": 2300}, "num_position_embeddings"),
        ({"depth": 4}, "deepstack_visual_indexes"),  # taps 8, 16, 24 beyond the 4 blocks
        ({"deepstack_visual_indexes": [1, 1]}, "deepstack_visual_indexes"),
        ({"hidden_act": "silu"}, "hidden_act"),
        ({"spatial_merge_size": 0}, "spatial_merge_size"),
        ({"rope_parameters": {"rope_type": "yarn"}}, "rope_type"),
        ({"patch_size": [16, 16]}, "patch_size"),
    ],
)
def test_invalid_values_name_the_field(d: dict, field_name: str) -> None:
    with pytest.raises(ValueError, match=field_name):
        VisionEncoderConfig.from_hf_dict(d)


def test_output_width_must_be_the_thinkers() -> None:
    with pytest.raises(ValueError, match="vision.out_hidden_size"):
        ThinkerConfig(vision=VisionEncoderConfig(out_hidden_size=1024))
    with pytest.raises(ValueError, match=r"thinker_config\.vision_config: depth must be an int"):
        Qwen3OmniConfig.from_hf_dict({"thinker_config": {"vision_config": {"depth": "27"}}})
