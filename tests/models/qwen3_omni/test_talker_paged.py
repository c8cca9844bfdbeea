"""`Talker.forward_paged` + `talker.step.step_paged`: sequences with different prefill lengths, stepped
frame by frame as one ragged paged batch (chunked prefill mixed with decode rows), produce the codes of
`turn.generate_frames` run on each alone (tiny preset, dummy weights, fp32)."""

from __future__ import annotations

import pytest
import torch
from paged_steps import last_rows, plan_step, shuffled_pages

from voice_server.models.paged import PagedKVCache, build_attention_context
from voice_server.models.qwen3_omni.config import Qwen3OmniConfig
from voice_server.models.qwen3_omni.loading import load_part
from voice_server.models.qwen3_omni.presets import tiny_config_dict
from voice_server.models.qwen3_omni.talker.model import Talker
from voice_server.models.qwen3_omni.talker.prefill import TalkerPrefill, text_vector_at
from voice_server.models.qwen3_omni.talker.sampling import TalkerSampling
from voice_server.models.qwen3_omni.talker.step import step_paged
from voice_server.models.qwen3_omni.turn import generate_frames

torch.set_num_threads(1)
ATOL = 1e-5
MAX_FRAMES = 8
PAGE_SIZE = 4
CHUNK_LEN = 6
PREFILL_LENS = (11, 6, 15)
TRAILING_LENS = (3, 1, 5)


@pytest.fixture(scope="module")
def talker() -> Talker:
    cfg = Qwen3OmniConfig.from_hf_dict(tiny_config_dict())
    model = load_part("talker", cfg, load_format="dummy", seed=5)
    assert isinstance(model, Talker)
    return model


def _prefill(talker: Talker, seq_len: int, num_trailing: int, seed: int) -> TalkerPrefill:
    """A synthetic prefill: `generate_frames` reads only the embeddings, positions and text vectors."""
    g = torch.Generator().manual_seed(seed)
    hidden = talker.cfg.hidden_size
    return TalkerPrefill(
        inputs_embeds=torch.randn(1, seq_len, hidden, generator=g),
        positions=torch.arange(seq_len).expand(3, 1, -1),
        trailing_text=torch.randn(1, num_trailing, hidden, generator=g),
        tts_pad=torch.randn(1, 1, hidden, generator=g),
        input_ids=torch.zeros(1, seq_len, dtype=torch.long),
    )


def _generators(seeds: list[int] | None, num_seqs: int) -> list[torch.Generator | None]:
    return [None] * num_seqs if seeds is None else [torch.Generator().manual_seed(s) for s in seeds]


@pytest.mark.parametrize("is_sampled", [False, True])
@torch.no_grad()
def test_batched_paged_frames_equal_generate_frames(talker: Talker, is_sampled: bool) -> None:
    # NOTE: TalkerSampling() is HF's talker_do_sample=False: greedy code 0 (with repetition penalty
    # and control-id suppression) and greedy residual codes. Sampled: HF's sampling defaults, one
    # seeded generator per sequence, drawn in the same order as `Talker.step` draws.
    sampling = TalkerSampling.hf_sampling() if is_sampled else TalkerSampling()
    seeds = [11, 12, 13] if is_sampled else None
    prefills = [_prefill(talker, n, t, seed=i) for i, (n, t) in enumerate(zip(PREFILL_LENS, TRAILING_LENS))]
    refs = [
        generate_frames(talker, p, MAX_FRAMES, sampling, g)
        for p, g in zip(prefills, _generators(seeds, len(prefills)), strict=True)
    ]
    cfg = talker.cfg
    num_seqs = len(prefills)
    generators = _generators(seeds, num_seqs)
    pages = shuffled_pages(num_seqs, 8)
    cache = PagedKVCache(cfg.num_hidden_layers, num_seqs * 8, PAGE_SIZE, cfg.num_key_value_heads, cfg.head_dim,
                         torch.float32)
    code0_seen = torch.zeros(num_seqs, cfg.vocab_size, dtype=torch.bool)
    rows: list[torch.Tensor] = [p.inputs_embeds[0] for p in prefills]  # fed rows, grown by each frame's input
    fed = [0] * num_seqs
    frames: list[list[tuple[torch.Tensor, torch.Tensor]]] = [[] for _ in prefills]
    is_done = [False] * num_seqs
    join_step = [0, 2, 1]
    saw_mixed_step = False
    for step in range(60):
        is_active = [step >= join_step[i] and not is_done[i] for i in range(num_seqs)]
        if not any(is_active):
            break
        chunks = plan_step(list(PREFILL_LENS), fed, is_active, CHUNK_LEN)
        saw_mixed_step |= len({c.num_rows > 1 for c in chunks}) == 2 and any(c.is_sampling for c in chunks)
        inputs = torch.cat([rows[c.seq][c.start : c.start + c.num_rows] for c in chunks])
        ctx, positions = build_attention_context(cache, [(c.start, c.num_rows, pages[c.seq]) for c in chunks],
                                                 inputs.shape[0])
        sampling_seqs = [c.seq for c in chunks if c.is_sampling]
        for c in chunks:
            fed[c.seq] += c.num_rows
        if not sampling_seqs:
            talker.forward_paged(inputs, positions, ctx, torch.zeros(0, dtype=torch.long))
            continue
        seq_index = torch.tensor(sampling_seqs)
        text_vec = torch.cat([text_vector_at(prefills[i], len(frames[i])) for i in sampling_seqs])
        seen = code0_seen[seq_index]
        out = step_paged(
            talker, inputs, positions, ctx, torch.tensor(last_rows(chunks), dtype=torch.long), text_vec, seen,
            [sampling] * len(sampling_seqs), [generators[i] for i in sampling_seqs],
        )
        code0_seen[seq_index] = seen
        for j, i in enumerate(sampling_seqs):
            if int(out.codes[j, 0]) == cfg.codec_eos_token_id:
                is_done[i] = True
                continue
            frames[i].append((out.codes[j], out.next_input_embeds[j]))
            rows[i] = torch.cat((rows[i], out.next_input_embeds[j : j + 1]))
            is_done[i] = len(frames[i]) == MAX_FRAMES
    assert saw_mixed_step and all(is_done)
    assert sum(len(r) for r in refs) >= 2 * num_seqs  # the sequences made real frames
    for got, ref in zip(frames, refs, strict=True):
        assert len(got) == len(ref)
        for (codes, next_input), want in zip(got, ref, strict=True):
            assert torch.equal(codes, want.codes[0])
            torch.testing.assert_close(next_input, want.next_input_embeds[0, 0], atol=ATOL, rtol=ATOL)


@torch.no_grad()
def test_step_paged_rejects_mismatched_rows(talker: Talker) -> None:
    cfg = talker.cfg
    cache = PagedKVCache(cfg.num_hidden_layers, 2, PAGE_SIZE, cfg.num_key_value_heads, cfg.head_dim, torch.float32)
    ctx, positions = build_attention_context(cache, [(0, 3, [0])], 3)
    inputs = torch.zeros(3, cfg.hidden_size)
    with pytest.raises(ValueError, match="text_vec"):
        step_paged(talker, inputs, positions, ctx, torch.tensor([2]), torch.zeros(2, cfg.hidden_size))
    with pytest.raises(ValueError, match="1 sequences, 2 samplings"):
        step_paged(talker, inputs, positions, ctx, torch.tensor([2]), torch.zeros(1, cfg.hidden_size),
                   samplings=[TalkerSampling()] * 2)
