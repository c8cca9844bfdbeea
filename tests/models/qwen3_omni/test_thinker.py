"""Thinker vs transformers' Qwen3OmniMoeThinkerForConditionalGeneration (tiny random fp32)."""

from __future__ import annotations

import pytest
import torch
import transformers

from voice_server.models.layers import KVCache
from voice_server.models.qwen3_omni.audio.encoder import num_audio_tokens
from voice_server.models.qwen3_omni.presets import TINY_IDS, tiny_config_dict, tiny_prompt_ids
from voice_server.models.qwen3_omni.thinker.config import ThinkerConfig
from voice_server.models.qwen3_omni.thinker.model import ThinkerModel
from voice_server.models.qwen3_omni.thinker.rope import decode_position_ids, get_rope_index

torch.set_num_threads(1)
TOL = 1e-4


@torch.no_grad()
def _randomize_(model: torch.nn.Module, seed: int = 0) -> None:
    g = torch.Generator().manual_seed(seed)
    for name, p in sorted(model.named_parameters()):
        r = torch.randn(p.shape, generator=g)
        p.copy_(1.0 + 0.1 * r if p.ndim == 1 and "norm" in name else 0.2 * r)


@pytest.fixture(scope="module")
def pair() -> tuple[ThinkerModel, torch.nn.Module]:
    d = tiny_config_dict()
    ref = transformers.Qwen3OmniMoeThinkerForConditionalGeneration(
        transformers.Qwen3OmniMoeConfig(**d).thinker_config
    ).eval()
    _randomize_(ref)
    ours = ThinkerModel(ThinkerConfig.from_hf_dict(d["thinker_config"])).eval()
    missing, unexpected = ours.load_state_dict(ref.state_dict(), strict=False)
    assert missing == []
    assert unexpected and all(k.startswith(ThinkerModel.IGNORED_STATE_PREFIXES) for k in unexpected)
    return ours, ref


def _max_err(a: torch.Tensor, b: torch.Tensor) -> float:
    assert a.shape == b.shape, (a.shape, b.shape)
    return (a - b).abs().max().item()


@torch.no_grad()
def test_text_only_logits_and_hidden_states(pair: tuple[ThinkerModel, torch.nn.Module]) -> None:
    ours, ref = pair
    ids = torch.tensor([tiny_prompt_ids(num_user_text=9)])
    expected = ref(input_ids=ids, attention_mask=torch.ones_like(ids), output_hidden_states=True)
    positions, _ = get_rope_index(ids, ours.cfg)
    num_layers = len(expected.hidden_states) - 1
    for k in range(num_layers + 1):
        got = ours(ids, positions, accept_hidden_layer=k)
        assert got.accepted_hidden is not None
        assert _max_err(got.accepted_hidden, expected.hidden_states[k]) <= TOL, k
    assert _max_err(got.logits, expected.logits) <= TOL
    assert _max_err(got.inputs_embeds, expected.hidden_states[0]) <= TOL
    assert expected.logits.abs().max() > 0.1  # the comparison is not between two near-zero tensors


@torch.no_grad()
def test_audio_input_through_the_tower(pair: tuple[ThinkerModel, torch.nn.Module]) -> None:
    ours, ref = pair
    g = torch.Generator().manual_seed(7)
    feature_lens = torch.tensor([230, 87])  # two clips, neither a multiple of the 100-frame chunk
    feats = torch.randn(2, 16, 230, generator=g)
    feature_mask = (torch.arange(230)[None] < feature_lens[:, None]).long()
    n_tok = [num_audio_tokens(int(n)) for n in feature_lens]
    ids_list = tiny_prompt_ids(num_user_text=3, num_audio_tokens=n_tok[0])
    clip2 = [TINY_IDS["audio_start"]] + [TINY_IDS["audio"]] * n_tok[1] + [TINY_IDS["audio_end"]]
    end1 = 3 + n_tok[0] + 2  # after the first clip's audio_end
    ids = torch.tensor([ids_list[:end1] + clip2 + ids_list[end1:]])
    mask = torch.ones_like(ids)
    expected = ref(
        input_ids=ids, attention_mask=mask, input_features=feats, feature_attention_mask=feature_mask,
        output_hidden_states=True,
    )
    packed = feats.permute(0, 2, 1)[feature_mask.bool()].permute(1, 0)
    audio = ours.encode_audio(packed, feature_lens)
    positions, deltas = get_rope_index(ids, ours.cfg, mask, feature_lens)
    got = ours(ids, positions, audio_embeds=audio, accept_hidden_layer=1)
    assert _max_err(got.inputs_embeds, expected.hidden_states[0]) <= TOL
    assert got.accepted_hidden is not None
    assert _max_err(got.accepted_hidden, expected.hidden_states[1]) <= TOL
    assert _max_err(got.logits, expected.logits) <= TOL
    assert int(deltas.abs().sum()) == 0


@torch.no_grad()
def test_incremental_decode_equals_full_forward(pair: tuple[ThinkerModel, torch.nn.Module]) -> None:
    ours, _ = pair
    ids = torch.tensor([tiny_prompt_ids(num_user_text=5) + [30, 31, 32, 33]])
    positions, deltas = get_rope_index(ids, ours.cfg)
    full = ours(ids, positions, accept_hidden_layer=1)
    split = ids.shape[1] - 4
    cache = KVCache(num_layers=ours.cfg.text.num_hidden_layers)
    steps = [ours(ids[:, :split], positions[:, :, :split], cache, accept_hidden_layer=1)]
    for t in range(split, ids.shape[1]):
        pos = decode_position_ids(cache.seq_len, 1, deltas)
        steps.append(ours(ids[:, t : t + 1], pos, cache, accept_hidden_layer=1))
    assert cache.seq_len == ids.shape[1]
    assert _max_err(torch.cat([s.logits for s in steps], 1), full.logits) <= TOL
    hidden = torch.cat([s.accepted_hidden for s in steps if s.accepted_hidden is not None], 1)
    assert _max_err(hidden, full.accepted_hidden) <= TOL  # type: ignore[arg-type]


@torch.no_grad()
def test_left_padded_batch_matches_single_rows(pair: tuple[ThinkerModel, torch.nn.Module]) -> None:
    ours, ref = pair
    long_row, short_row = tiny_prompt_ids(num_user_text=7), tiny_prompt_ids(num_user_text=3)
    pad = len(long_row) - len(short_row)
    ids = torch.tensor([long_row, [0] * pad + short_row])
    mask = torch.tensor([[1] * len(long_row), [0] * pad + [1] * len(short_row)])
    positions, _ = get_rope_index(ids, ours.cfg, mask)
    expected = ref(input_ids=ids, attention_mask=mask).logits
    got = ours(ids, positions, attention_mask=mask).logits
    assert _max_err(got[mask.bool()], expected[mask.bool()]) <= TOL


@torch.no_grad()
def test_dense_mlp_layers_match_hf() -> None:
    d = tiny_config_dict()
    d["thinker_config"]["text_config"]["mlp_only_layers"] = [0]  # layer 0 dense SwiGLU, layer 1 MoE
    ref = transformers.Qwen3OmniMoeThinkerForConditionalGeneration(
        transformers.Qwen3OmniMoeConfig(**d).thinker_config
    ).eval()
    _randomize_(ref, seed=3)
    ours = ThinkerModel(ThinkerConfig.from_hf_dict(d["thinker_config"])).eval()
    ours.load_state_dict({k: v for k, v in ref.state_dict().items() if not k.startswith("model.visual.")})
    ids = torch.tensor([tiny_prompt_ids(num_user_text=4)])
    positions, _ = get_rope_index(ids, ours.cfg)
    assert _max_err(ours(ids, positions).logits, ref(input_ids=ids).logits) <= TOL


@torch.no_grad()
def test_left_padded_batch_decode_matches_single_rows(pair: tuple[ThinkerModel, torch.nn.Module]) -> None:
    ours, _ = pair
    rows = [tiny_prompt_ids(num_user_text=7), tiny_prompt_ids(num_user_text=2)]
    width = max(map(len, rows))
    ids = torch.tensor([[0] * (width - len(r)) + r for r in rows])
    mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows])
    positions, deltas = get_rope_index(ids, ours.cfg, mask)
    cache = KVCache(ours.cfg.text.num_hidden_layers)
    out = ours(ids, positions, cache, attention_mask=mask)
    batch_logits = [out.logits[:, -1]]
    for token in ([40, 41], [42, 43]):
        mask = torch.cat([mask, torch.ones(2, 1, dtype=torch.long)], 1)
        pos = decode_position_ids(mask[:, :-1].sum(-1), 1, deltas)
        batch_logits.append(ours(torch.tensor([token]).T, pos, cache, attention_mask=mask).logits[:, -1])
    for b, row in enumerate(rows):
        full = torch.tensor([row + [40 + b, 42 + b]])
        single = ours(full, get_rope_index(full, ours.cfg)[0]).logits[0, -3:]
        assert _max_err(torch.stack([lg[b] for lg in batch_logits]), single) <= TOL


def test_rope_index_matches_hf(pair: tuple[ThinkerModel, torch.nn.Module]) -> None:
    ours, ref = pair
    n_tok = num_audio_tokens(330)
    ids = torch.tensor([tiny_prompt_ids(num_user_text=4, num_audio_tokens=n_tok)])
    mask = torch.ones_like(ids)
    lens = torch.tensor([330])
    got, got_deltas = get_rope_index(ids, ours.cfg, mask, lens)
    # HF runs its text branch for audio-only prompts, and the per-segment walk when a grid is passed:
    # both must agree with ours.
    for grid in (None, torch.zeros(0, 3, dtype=torch.long)):
        exp, exp_deltas = ref.get_rope_index(ids, image_grid_thw=grid, attention_mask=mask, audio_seqlens=lens)
        assert torch.equal(got, exp.long())
        assert torch.equal(got_deltas, exp_deltas.long())
    padded = torch.cat([torch.zeros(1, 3, dtype=torch.long), ids], 1)
    pmask = torch.cat([torch.zeros(1, 3, dtype=torch.long), mask], 1)
    exp, exp_deltas = ref.get_rope_index(padded, attention_mask=pmask, audio_seqlens=lens)
    got, got_deltas = get_rope_index(padded, ours.cfg, pmask, lens)
    assert torch.equal(got, exp.long()) and torch.equal(got_deltas, exp_deltas.long())


def test_rope_index_rejects_wrong_placeholder_count(pair: tuple[ThinkerModel, torch.nn.Module]) -> None:
    ours, _ = pair
    ids = torch.tensor([tiny_prompt_ids(num_audio_tokens=num_audio_tokens(330) - 1)])
    with pytest.raises(ValueError, match="placeholder"):
        get_rope_index(ids, ours.cfg, audio_feature_lens=torch.tensor([330]))


def test_embed_rejects_missing_audio(pair: tuple[ThinkerModel, torch.nn.Module]) -> None:
    ours, _ = pair
    ids = torch.tensor([tiny_prompt_ids(num_audio_tokens=5)])
    with pytest.raises(ValueError, match="5 audio placeholder"):
        ours.embed(ids)


def test_meta_construction_at_release_size() -> None:
    with torch.device("meta"):
        model = ThinkerModel(ThinkerConfig())
    assert list(model.buffers()) == []
    num_params = sum(p.numel() for p in model.parameters())
    # Release thinker (31,719,205,488 in the reference notes) minus its 538,631,408-parameter vision tower.
    assert num_params == 31_180_574_080
    assert sum(p.numel() for p in model.model.audio_tower.parameters()) == 647_927_168
