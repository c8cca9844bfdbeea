"""Code predictor (MTP) parity against transformers' per-frame `code_predictor.generate` (fp32, tiny)."""

from __future__ import annotations

import pytest
import torch
from transformers.models.qwen3_omni_moe.configuration_qwen3_omni_moe import (
    Qwen3OmniMoeTalkerCodePredictorConfig,
)
from transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe import (
    Qwen3OmniMoeTalkerCodePredictorModelForConditionalGeneration,
)

from voice_server.models.qwen3_omni.presets import tiny_config_dict
from voice_server.models.qwen3_omni.talker.code_predictor import CodePredictor
from voice_server.models.qwen3_omni.talker.config import CodePredictorConfig
from voice_server.models.qwen3_omni.talker.sampling import CodebookSampling, select_tokens

torch.set_num_threads(1)
ATOL = 1e-4
H = 16


def tiny_cp_dict(num_code_groups: int = 4) -> dict:
    d = dict(tiny_config_dict()["talker_config"]["code_predictor_config"])
    d.update(num_hidden_layers=2, num_code_groups=num_code_groups)  # 2 layers: the KV cache really matters
    return d


def build_pair(
    num_code_groups: int = 4, seed: int = 0
) -> tuple[CodePredictor, Qwen3OmniMoeTalkerCodePredictorModelForConditionalGeneration]:
    d = tiny_cp_dict(num_code_groups)
    hf = Qwen3OmniMoeTalkerCodePredictorModelForConditionalGeneration(
        Qwen3OmniMoeTalkerCodePredictorConfig(**d)
    ).eval()
    g = torch.Generator().manual_seed(seed)
    sd = {}
    for name, p in sorted(hf.state_dict().items()):
        r = torch.randn(p.shape, generator=g)
        sd[name] = 1.0 + 0.1 * r if name.endswith("norm.weight") else (r if "embedding" in name else 0.3 * r)
    hf.load_state_dict(sd)
    ours = CodePredictor(CodePredictorConfig.from_hf_dict(d)).eval()
    ours.load_state_dict(sd)
    return ours, hf


def hf_frame(hf: torch.nn.Module, talker_hidden: torch.Tensor, code0_embed: torch.Tensor, **kwargs: object):
    # Exactly the call Qwen3OmniMoeTalkerForConditionalGeneration.prepare_inputs_for_generation makes.
    num_groups = hf.config.num_code_groups
    return hf.generate(
        inputs_embeds=torch.stack((talker_hidden, code0_embed), dim=1), max_new_tokens=num_groups - 1,
        output_hidden_states=True, output_logits=True, return_dict_in_generate=True, **kwargs,
    )


@pytest.mark.parametrize("num_code_groups", [4, 16])
@torch.no_grad()
def test_greedy_frame_matches_hf_generate(num_code_groups: int) -> None:
    ours, hf = build_pair(num_code_groups, seed=num_code_groups)
    g = torch.Generator().manual_seed(7)
    talker_hidden, code0_embed = torch.randn(3, H, generator=g), torch.randn(3, H, generator=g)

    ref = hf_frame(hf, talker_hidden, code0_embed, do_sample=False)
    fill = ours.fill(talker_hidden, code0_embed)

    assert fill.codes.shape == (3, num_code_groups - 1)
    assert torch.equal(fill.codes, ref.sequences)
    ref_logits = torch.stack(ref.logits, dim=1)
    assert ref_logits.abs().max() > 0.5
    assert (fill.logits - ref_logits).abs().max().item() <= ATOL
    # Feedback summands: HF records decode step k's input, codec_embedding[k-1](code k), as hidden_states[k][0].
    ref_mid = torch.cat([h[0] for h in ref.hidden_states[1:]], dim=1)
    assert (fill.embeds[:, :-1] - ref_mid).abs().max().item() <= ATOL
    last = hf.get_input_embeddings()[-1](ref.sequences[:, -1])
    assert (fill.embeds[:, -1] - last).abs().max().item() <= ATOL


@torch.no_grad()
def test_sampled_frame_matches_hf_with_same_seed() -> None:
    # HF samples with the global generator; ours with an explicit one seeded the same way, so the
    # multinomial draws line up when the processed distributions agree (top-k 50, top-p 0.8 as HF).
    ours, hf = build_pair(16, seed=5)
    g = torch.Generator().manual_seed(8)
    talker_hidden, code0_embed = torch.randn(2, H, generator=g), torch.randn(2, H, generator=g)
    params = CodebookSampling(is_greedy=False, temperature=1.0, top_k=50, top_p=0.8)
    torch.manual_seed(123)
    ref = hf_frame(hf, talker_hidden, code0_embed, do_sample=True, top_k=50, top_p=0.8)
    fill = ours.fill(talker_hidden, code0_embed, params, torch.Generator().manual_seed(123))
    greedy = ours.fill(talker_hidden, code0_embed)
    assert torch.equal(fill.codes, ref.sequences)
    assert not torch.equal(fill.codes, greedy.codes)  # the draw really sampled


def test_select_tokens_top_k_top_p_restrict_support() -> None:
    logits = torch.tensor([[4.0, 3.0, 2.0, 1.0, 0.0]]).expand(200, -1)
    gen = torch.Generator().manual_seed(0)
    top2 = select_tokens(logits, CodebookSampling(is_greedy=False, top_k=2), gen)
    assert set(top2.tolist()) == {0, 1}
    # softmax([4,3,2,1,0]) = [.64, .24, .09, ..]: top-p 0.8 keeps ids 0 and 1 only.
    nucleus = select_tokens(logits, CodebookSampling(is_greedy=False, top_p=0.8), gen)
    assert set(nucleus.tolist()) == {0, 1}
    assert select_tokens(logits[:1], CodebookSampling()).item() == 0
    with pytest.raises(ValueError, match="top_p"):
        CodebookSampling(top_p=0.0)
