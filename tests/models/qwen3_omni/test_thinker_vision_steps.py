"""The thinker with images and videos step by step: `forward_paged` with a chunked prefill that cuts image
and video blocks (each chunk carrying only its own rows' DeepStack features) equals the dense `forward`,
and a greedy `run_greedy_thinker` turn with an image and a video equals transformers' `generate`.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
from paged_steps import last_rows, plan_step, shuffled_pages
from thinker_vision_reference import (
    IDS,
    PROMPTS,
    audio_inputs,
    chat,
    hf_tower,
    thinker_pair,
    visual_inputs,
)

from voice_server.models.layers import KVCache
from voice_server.models.paged import PagedKVCache, build_attention_context
from voice_server.models.qwen3_omni.thinker.model import ThinkerModel
from voice_server.models.qwen3_omni.thinker.rope import decode_position_ids, get_rope_index
from voice_server.models.qwen3_omni.thinker.visual import Deepstack, VisualInputs
from voice_server.models.qwen3_omni.turn import run_greedy_thinker

torch.set_num_threads(1)
ATOL = 1e-5
NUM_DECODE = 4
PAGE_SIZE = 4
CHUNK_LEN = 5
PAGED_PROMPTS = ("image", "text", "video_fractional_time", "audio_in_video")


@pytest.fixture(scope="module")
def pair() -> tuple[ThinkerModel, torch.nn.Module]:
    return thinker_pair(seed=1)


@dataclass(frozen=True)
class Sequence:
    """One prompt's inputs as a runner holds them: its rows' embeddings, positions and DeepStack features."""

    ids: list[int]
    embeds: torch.Tensor  # [L, H]: audio / image / video features scattered in
    positions: torch.Tensor  # [3, L] int64 or float32
    delta: torch.Tensor  # [1, 1]
    deepstack: Deepstack | None  # rows = prompt positions
    visual: VisualInputs | None
    audio: torch.Tensor | None


def _sequence(ours: ThinkerModel, ref: torch.nn.Module, name: str) -> Sequence:
    if name == "text":
        ids = torch.tensor([chat([40, 41, 42])])
        positions, delta = get_rope_index(ids, ours.cfg)
        return Sequence(ids[0].tolist(), ours.embed(ids[0]), positions[:, 0], delta, None, None, None)
    ids = PROMPTS[name].input_ids
    media = PROMPTS[name].media(ours.cfg.vision.patch_dim, ours.cfg.audio.num_mel_bins)
    visual = visual_inputs(hf_tower(ref), media)
    audio, feature_lens = audio_inputs(ours, media)
    positions, delta = get_rope_index(ids, ours.cfg, None, feature_lens, **visual.rope_grids())
    return Sequence(
        ids[0].tolist(), ours.embed(ids[0], audio, visual), positions[:, 0], delta, ours.deepstack(ids[0], visual),
        visual, audio,
    )


@torch.no_grad()
def _dense(ours: ThinkerModel, seq: Sequence) -> tuple[list[int], torch.Tensor]:
    """(ids fed: prompt then greedy tokens, logits [1 + NUM_DECODE, V]) from the contiguous-cache forward."""
    cache = KVCache(ours.cfg.text.num_hidden_layers)
    ids = torch.tensor([seq.ids])
    out = ours(ids, seq.positions[:, None], cache, audio_embeds=seq.audio, visual=seq.visual)
    fed, logits = list(seq.ids), [out.logits[0, -1]]
    for _ in range(NUM_DECODE):
        fed.append(int(logits[-1].argmax()))
        out = ours(torch.tensor([fed[-1:]]), decode_position_ids(cache.seq_len, 1, seq.delta), cache)
        logits.append(out.logits[0, -1])
    return fed, torch.stack(logits)


@torch.no_grad()
def test_paged_chunks_cutting_visual_blocks_equal_dense_forward(pair: tuple[ThinkerModel, torch.nn.Module]) -> None:
    ours, ref = pair
    seqs = [_sequence(ours, ref, name) for name in PAGED_PROMPTS]
    refs = [_dense(ours, s) for s in seqs]
    text = ours.cfg.text
    pages = shuffled_pages(len(seqs), 24)
    cache = PagedKVCache(text.num_hidden_layers, len(seqs) * 24, PAGE_SIZE, text.num_key_value_heads, text.head_dim,
                         torch.float32)
    prompt_lens = [len(s.ids) for s in seqs]
    fed_ids = [list(s.ids) for s in seqs]
    fed, got_logits = [0] * len(seqs), [[] for _ in seqs]  # type: ignore[var-annotated]
    num_cut_chunks = 0
    for _ in range(100):
        is_active = [len(g) <= NUM_DECODE for g in got_logits]
        if not any(is_active):
            break
        chunks = plan_step(prompt_lens, fed, is_active, CHUNK_LEN)
        num_rows = sum(c.num_rows for c in chunks) + 1  # one padding row
        input_ids = torch.tensor([t for c in chunks for t in fed_ids[c.seq][c.start : c.start + c.num_rows]] + [0])
        ctx, _ = build_attention_context(cache, [(c.start, c.num_rows, pages[c.seq]) for c in chunks], num_rows)
        embeds = ours.model.language_model.embed_tokens(input_ids)
        positions, parts, row = [], [], 0
        for c in chunks:
            seq, end = seqs[c.seq], c.start + c.num_rows
            if c.start < prompt_lens[c.seq]:  # a prefill chunk: the prompt's own rows
                embeds[row : row + c.num_rows] = seq.embeds[c.start : end]
                positions.append(seq.positions[:, c.start : end].float())
                if seq.deepstack is not None:
                    part = seq.deepstack.slice_rows(c.start, end, row)
                    parts.append(part)
                    num_cut_chunks += 0 < part.rows.numel() < seq.deepstack.rows.numel()
            else:
                positions.append(decode_position_ids(c.start, 1, seq.delta)[:, 0].float())
            row += c.num_rows
        positions.append(torch.zeros(3, 1))
        # NOTE: a step holding a fractional-time video runs all its rows in float32 (exact for whole positions).
        step_positions = torch.cat(positions, 1)
        if torch.equal(step_positions, step_positions.round()):
            step_positions = step_positions.long()
        logits_indices = torch.tensor(last_rows(chunks), dtype=torch.long)
        out = ours.forward_paged(input_ids, step_positions, ctx, logits_indices, embeds,
                                 deepstack=Deepstack.concat(parts))
        sampled = iter(out.logits)
        for c in chunks:
            fed[c.seq] += c.num_rows
            if c.is_sampling:
                got_logits[c.seq].append(next(sampled))
                if len(got_logits[c.seq]) <= NUM_DECODE:
                    fed_ids[c.seq].append(int(got_logits[c.seq][-1].argmax()))
    assert num_cut_chunks >= 3  # image, video and audio-in-video blocks were each cut by a chunk boundary
    for i, (ids, logits) in enumerate(refs):
        assert fed_ids[i] == ids
        torch.testing.assert_close(torch.stack(got_logits[i]), logits, atol=ATOL, rtol=0)


@pytest.mark.parametrize("name", ["image", "image_video", "audio_in_video"])
@torch.no_grad()
def test_greedy_thinker_turn_matches_hf_generate(pair: tuple[ThinkerModel, torch.nn.Module], name: str) -> None:
    ours, ref = pair
    ids = PROMPTS[name].input_ids
    media = PROMPTS[name].media(ours.cfg.vision.patch_dim, ours.cfg.audio.num_mel_bins)
    expected = ref.generate(input_ids=ids, **media, max_new_tokens=6, do_sample=False, eos_token_id=IDS["im_end"])
    packed, feature_lens = None, None
    if "input_features" in media:
        mask = media["feature_attention_mask"]
        packed, feature_lens = media["input_features"].permute(0, 2, 1)[mask.bool()].permute(1, 0), mask.sum(-1)
    turn = run_greedy_thinker(
        ours, ids, 1, IDS["im_end"], 6, packed, feature_lens, visual=visual_inputs(hf_tower(ref), media)
    )
    assert torch.equal(turn.text_ids, expected)
    assert turn.text_ids.shape[1] > ids.shape[1] + 2
