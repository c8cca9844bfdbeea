"""`ThinkerModel.forward_paged`: sequences of different lengths (one with an audio block) run as one ragged
paged batch with chunked prefill give what `ThinkerModel.forward` gives each alone with a contiguous cache
(tiny preset, dummy weights, fp32)."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
from paged_steps import last_rows, plan_step, shuffled_pages

from voice_server.models.layers import KVCache
from voice_server.models.paged import PagedKVCache, build_attention_context
from voice_server.models.qwen3_omni.config import Qwen3OmniConfig
from voice_server.models.qwen3_omni.loading import load_part
from voice_server.models.qwen3_omni.presets import TINY_IDS, tiny_config_dict, tiny_prompt_ids
from voice_server.models.qwen3_omni.thinker.model import ThinkerModel
from voice_server.models.qwen3_omni.thinker.rope import decode_position_ids, get_rope_index

torch.set_num_threads(1)
ATOL = 1e-5
NUM_DECODE = 4
PAGE_SIZE = 4
CHUNK_LEN = 5
NUM_PADDING = 2


@dataclass(frozen=True)
class Reference:
    """One sequence alone: ids fed, their embeddings and accepted hidden states, sampled logits."""

    ids: list[int]  # prompt, then the greedy tokens fed back
    inputs_embeds: torch.Tensor  # [len(ids), H]
    accepted: torch.Tensor | None  # [len(ids), H]
    logits: torch.Tensor  # [1 + NUM_DECODE, V]: at the last prompt row, then each decode row


@pytest.fixture(scope="module")
def thinker() -> ThinkerModel:
    cfg = Qwen3OmniConfig.from_hf_dict(tiny_config_dict())
    model = load_part("thinker", cfg, load_format="dummy", seed=3)
    assert isinstance(model, ThinkerModel)
    return model


def _prompts(thinker: ThinkerModel) -> list[tuple[list[int], torch.Tensor | None]]:
    audio = torch.randn(6, thinker.cfg.text.hidden_size, generator=torch.Generator().manual_seed(1))
    return [
        (tiny_prompt_ids(num_user_text=9), None),
        (tiny_prompt_ids(num_user_text=3, num_audio_tokens=6), audio),
        (tiny_prompt_ids(num_user_text=1), None),
    ]


@torch.no_grad()
def _reference(thinker: ThinkerModel, prompt: list[int], audio: torch.Tensor | None, layer: int) -> Reference:
    cache = KVCache(thinker.cfg.text.num_hidden_layers)
    ids = torch.tensor([prompt])
    positions, deltas = get_rope_index(ids, thinker.cfg)
    out = thinker(ids, positions, cache, audio_embeds=audio, accept_hidden_layer=layer)
    fed, embeds, accepted, logits = list(prompt), [out.inputs_embeds[0]], [out.accepted_hidden], [out.logits[0, -1]]
    for _ in range(NUM_DECODE):
        next_id = int(logits[-1].argmax())
        fed.append(next_id)
        out = thinker(torch.tensor([[next_id]]), decode_position_ids(cache.seq_len, 1, deltas), cache,
                      accept_hidden_layer=layer)
        embeds.append(out.inputs_embeds[0])
        accepted.append(out.accepted_hidden)
        logits.append(out.logits[0, -1])
    hidden = None if layer is None else torch.cat([a[0] for a in accepted if a is not None])
    return Reference(fed, torch.cat(embeds), hidden, torch.stack(logits))


@pytest.mark.parametrize("layer", [0, 1, 2])
@torch.no_grad()
def test_ragged_paged_steps_equal_contiguous_forward(thinker: ThinkerModel, layer: int) -> None:
    prompts = _prompts(thinker)
    refs = [_reference(thinker, p, a, layer) for p, a in prompts]
    text = thinker.cfg.text
    # NOTE: the audio prompt's rows are fed from its full embeddings (audio scattered in), as a runner does.
    audio_embeds = [None if a is None else thinker.embed(torch.tensor([p]), a)[0] for p, a in prompts]
    prompt_lens = [len(p) for p, _ in prompts]
    pages = shuffled_pages(len(prompts), 8)
    cache = PagedKVCache(text.num_hidden_layers, 3 * 8, PAGE_SIZE, text.num_key_value_heads, text.head_dim,
                         torch.float32)
    fed_ids: list[list[int]] = [list(p) for p, _ in prompts]  # grows by each greedy token
    fed = [0] * len(prompts)
    num_sampled = [0] * len(prompts)
    got_embeds: list[list[torch.Tensor]] = [[] for _ in prompts]
    got_accepted: list[list[torch.Tensor]] = [[] for _ in prompts]
    got_logits: list[list[torch.Tensor]] = [[] for _ in prompts]
    join_step = [0, 1, 3]
    saw_mixed_step = saw_audio_rows = False
    for step in range(40):
        is_active = [step >= join_step[i] and num_sampled[i] <= NUM_DECODE for i in range(len(prompts))]
        if not any(is_active):
            break
        chunks = plan_step(prompt_lens, fed, is_active, CHUNK_LEN)
        saw_mixed_step |= len({c.num_rows > 1 for c in chunks}) == 2
        num_rows = sum(c.num_rows for c in chunks) + NUM_PADDING
        ids = [t for c in chunks for t in fed_ids[c.seq][c.start : c.start + c.num_rows]] + [0] * NUM_PADDING
        ctx, positions = build_attention_context(cache, [(c.start, c.num_rows, pages[c.seq]) for c in chunks],
                                                 num_rows)
        input_ids = torch.tensor(ids)
        embeds = None
        if any(audio_embeds[c.seq] is not None and c.start < prompt_lens[c.seq] for c in chunks):
            saw_audio_rows |= bool((input_ids == TINY_IDS["audio"]).any())
            embeds = thinker.model.language_model.embed_tokens(input_ids)
            row = 0
            for c in chunks:
                full = audio_embeds[c.seq]
                if full is not None and c.start < prompt_lens[c.seq]:
                    embeds[row : row + c.num_rows] = full[c.start : c.start + c.num_rows]
                row += c.num_rows
        out = thinker.forward_paged(input_ids, positions, ctx, torch.tensor(last_rows(chunks), dtype=torch.long),
                                     embeds, layer)
        row, sampled = 0, iter(out.logits)
        for c in chunks:
            got_embeds[c.seq].append(out.inputs_embeds[row : row + c.num_rows])
            if out.accepted_hidden is not None:
                got_accepted[c.seq].append(out.accepted_hidden[row : row + c.num_rows])
            row += c.num_rows
            fed[c.seq] += c.num_rows
            if c.is_sampling:
                logits = next(sampled)
                got_logits[c.seq].append(logits)
                num_sampled[c.seq] += 1
                if num_sampled[c.seq] <= NUM_DECODE:
                    fed_ids[c.seq].append(int(logits.argmax()))
    assert saw_mixed_step and saw_audio_rows and num_sampled == [NUM_DECODE + 1] * len(prompts)
    for i, ref in enumerate(refs):
        assert fed_ids[i] == ref.ids  # greedy ids equal
        torch.testing.assert_close(torch.stack(got_logits[i]), ref.logits, atol=ATOL, rtol=ATOL)
        torch.testing.assert_close(torch.cat(got_embeds[i]), ref.inputs_embeds, atol=0, rtol=0)
        assert ref.accepted is not None
        torch.testing.assert_close(torch.cat(got_accepted[i]), ref.accepted, atol=ATOL, rtol=ATOL)


def test_forward_paged_rejects_bad_shapes(thinker: ThinkerModel) -> None:
    text = thinker.cfg.text
    cache = PagedKVCache(text.num_hidden_layers, 2, PAGE_SIZE, text.num_key_value_heads, text.head_dim,
                         torch.float32)
    ctx, positions = build_attention_context(cache, [(0, 3, [0])], 3)
    with pytest.raises(ValueError, match="inputs_embeds"):
        thinker.forward_paged(torch.zeros(3, dtype=torch.long), positions, ctx, torch.tensor([2]),
                              torch.zeros(3, text.hidden_size + 1))
    with pytest.raises(ValueError, match="accept_hidden_layer"):
        thinker.forward_paged(torch.zeros(3, dtype=torch.long), positions, ctx, torch.tensor([2]),
                              accept_hidden_layer=3)
