"""Talker decoder parity against transformers' Qwen3OmniMoeTalkerForConditionalGeneration (fp32, tiny)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch
from transformers.cache_utils import DynamicCache
from transformers.models.qwen3_omni_moe.configuration_qwen3_omni_moe import (
    Qwen3OmniMoeTalkerConfig,
)
from transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe import (
    Qwen3OmniMoeTalkerForConditionalGeneration,
)

from voice_server.models.layers import KVCache
from voice_server.models.qwen3_omni.presets import TINY_CODEBOOK, TINY_NUM_CODE_GROUPS, tiny_config_dict
from voice_server.models.qwen3_omni.talker.config import TalkerConfig
from voice_server.models.qwen3_omni.talker.model import Talker

torch.set_num_threads(1)
ATOL = 1e-4
H, G, CODEBOOK = 16, TINY_NUM_CODE_GROUPS, TINY_CODEBOOK


def tiny_talker_dict() -> dict:
    # The preset's talker: hidden 16, G=4 code groups, codebook 32, mrope sections (2, 1, 1).
    return tiny_config_dict()["talker_config"]


def seeded_state_dict(module: torch.nn.Module, seed: int = 0) -> dict[str, torch.Tensor]:
    # NOTE: HF leaves talker experts uninitialised and the router at zero; randomise everything,
    # with std large enough that logits are O(1) and the parity check is not trivially small.
    g = torch.Generator().manual_seed(seed)
    out = {}
    for name, p in sorted(module.state_dict().items()):
        r = torch.randn(p.shape, generator=g)
        if name.endswith("norm.weight"):
            out[name] = 1.0 + 0.1 * r
        elif "embedding" in name:
            out[name] = r
        else:
            out[name] = 0.3 * r
    return out


def build_pair(seed: int = 0) -> tuple[Talker, Qwen3OmniMoeTalkerForConditionalGeneration]:
    d = tiny_talker_dict()
    hf = Qwen3OmniMoeTalkerForConditionalGeneration(Qwen3OmniMoeTalkerConfig(**d)).eval()
    sd = seeded_state_dict(hf, seed)
    hf.load_state_dict(sd)
    ours = Talker(TalkerConfig.from_hf_dict(d)).eval()
    ours.load_state_dict(sd)
    return ours, hf


def test_config_from_hf_dict_reads_every_field() -> None:
    cfg = TalkerConfig.from_hf_dict(tiny_talker_dict())
    assert (cfg.hidden_size, cfg.num_experts, cfg.num_experts_per_tok) == (H, 4, 2)
    assert cfg.shared_expert_intermediate_size == 16 and cfg.is_norm_topk_prob
    assert cfg.mrope_section == (2, 1, 1) and cfg.rope_theta == 1e6
    assert cfg.code_predictor.num_code_groups == G and cfg.code_predictor.vocab_size == CODEBOOK
    assert cfg.codec_eos_token_id == 1042 and cfg.speaker_token_id("Ethan") == 1050
    with pytest.raises(ValueError, match="unknown speaker"):
        cfg.speaker_token_id("nobody")


def test_config_validation_names_the_field() -> None:
    d = tiny_talker_dict()
    d["num_code_groups"] = 5
    with pytest.raises(ValueError, match="num_code_groups"):
        TalkerConfig.from_hf_dict(d)
    d = tiny_talker_dict()
    d["text_config"]["num_experts_per_tok"] = 9
    with pytest.raises(ValueError, match="num_experts_per_tok"):
        TalkerConfig.from_hf_dict(d)


def test_param_names_and_shapes_equal_hf_and_meta_build() -> None:
    d = tiny_talker_dict()
    hf = Qwen3OmniMoeTalkerForConditionalGeneration(Qwen3OmniMoeTalkerConfig(**d))
    with torch.device("meta"):
        ours = Talker(TalkerConfig.from_hf_dict(d))
    ours_shapes = {k: tuple(v.shape) for k, v in ours.state_dict().items()}
    hf_shapes = {k: tuple(v.shape) for k, v in hf.state_dict().items()}
    assert ours_shapes == hf_shapes
    assert all(p.is_meta for p in ours.parameters())
    # A meta-built model becomes usable after an assign-load (rope tables are not meta buffers).
    ours.load_state_dict(seeded_state_dict(hf), assign=True)
    logits, _ = ours(torch.randn(1, 3, H), torch.arange(3)[None], KVCache(2))
    assert logits.shape == (1, 3, 1024 + CODEBOOK) and torch.isfinite(logits).all()


@torch.no_grad()
def test_logits_match_hf_prefill_then_decode() -> None:
    ours, hf = build_pair(seed=1)
    g = torch.Generator().manual_seed(3)
    prefill = torch.randn(2, 9, H, generator=g)
    steps = [torch.randn(2, 1, H, generator=g) for _ in range(4)]

    cache = DynamicCache(config=hf.config.text_config)
    ref = [hf(inputs_embeds=prefill, cache=cache, use_cache=True).logits]
    ref += [hf(inputs_embeds=x, cache=cache, use_cache=True, generation_step=0).logits for x in steps]

    kv = KVCache(len(ours.model.layers))
    got = [ours(prefill, torch.arange(9).expand(2, -1), kv)[0]]
    got += [ours(x, torch.full((2, 1), 9 + i), kv)[0] for i, x in enumerate(steps)]

    assert ref[0].abs().max() > 0.5  # non-trivial logits
    for r, o in zip(ref, got):
        assert (r - o).abs().max().item() <= ATOL


@torch.no_grad()
def test_logits_match_hf_with_distinct_thw_positions() -> None:
    ours, hf = build_pair(seed=2)
    g = torch.Generator().manual_seed(4)
    x = torch.randn(1, 7, H, generator=g)
    thw = torch.stack([torch.arange(7) * 3, torch.arange(7) % 3, torch.arange(7) // 2 + 5])[:, None]  # [3,1,7]
    text = torch.arange(7)[None, None]
    ref = hf(inputs_embeds=x, position_ids=torch.cat([text, thw]), use_cache=False).logits
    got = ours(x, thw, None)[0]
    seq = ours(x, torch.arange(7)[None], None)[0]
    assert (ref - got).abs().max().item() <= ATOL
    assert (seq - got).abs().max().item() > 1e-3  # the t/h/w split really changes the result


@torch.no_grad()
def test_left_padded_batch_row_matches_unpadded() -> None:
    ours, _ = build_pair(seed=3)
    g = torch.Generator().manual_seed(5)
    x = torch.randn(1, 5, H, generator=g)
    alone = ours(x, torch.arange(5)[None], KVCache(2))[0]
    padded = torch.cat([torch.randn(1, 2, H, generator=g), x], dim=1)
    key_mask = torch.tensor([[False, False, True, True, True, True, True]])
    positions = torch.tensor([[0, 0, 0, 1, 2, 3, 4]])
    batched = ours(padded, positions, KVCache(2), key_mask)[0]
    assert (batched[:, 2:] - alone).abs().max().item() <= ATOL


@torch.no_grad()
def test_step_batch_rows_equal_single_rows_and_bf16_runs() -> None:
    ours, _ = build_pair(seed=4)
    g = torch.Generator().manual_seed(6)
    prefill, text = torch.randn(2, 6, H, generator=g), torch.randn(2, H, generator=g)
    batched = ours.step(prefill, torch.arange(6).expand(2, -1), KVCache(2), text)
    for row in range(2):
        single = ours.step(prefill[row : row + 1], torch.arange(6)[None], KVCache(2), text[row : row + 1])
        assert torch.equal(single.codes, batched.codes[row : row + 1])
        assert (single.next_input_embeds - batched.next_input_embeds[row : row + 1]).abs().max().item() <= ATOL
    assert batched.codes.shape == (2, G) and batched.next_input_embeds.shape == (2, 1, H)
    assert (batched.codes[:, 1:] < CODEBOOK).all()

    half = ours.to(torch.bfloat16)
    out = half.step(prefill.bfloat16(), torch.arange(6).expand(2, -1), KVCache(2), text.bfloat16())
    assert out.next_input_embeds.dtype == torch.bfloat16 and torch.isfinite(out.next_input_embeds.float()).all()
    assert out.codes.shape == (2, G)


def test_bench_talker_runs_and_agrees_with_reference() -> None:
    # The bench itself raises if our fused step and the transformers reference emit different codes.
    path = Path(__file__).resolve().parents[3] / "loadtest" / "bench_talker.py"
    spec = importlib.util.spec_from_file_location("bench_talker", path)
    assert spec is not None and spec.loader is not None
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    rows = bench.run(num_frames=3, num_rounds=1)
    assert [r["frames"] for r in rows] == [3, 3, 2]
    assert all(r["mean_ms"] > 0 for r in rows)
