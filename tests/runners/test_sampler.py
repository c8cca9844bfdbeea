"""Sampling pieces against transformers' logits processors, and incremental detokenisation."""

from __future__ import annotations

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers

from voice_server.models.llama.tokenizer import bytes_to_unicode
from voice_server.models.sampling import penalize_histories, race, top_k_top_p_mask
from voice_server.runners.detok import Detokenizer, Piece, token_bytes_table
from voice_server.runners.sampler import Sampler
from voice_server.scheduling.contract import SamplingParams

torch.set_num_threads(1)
VOCAB = 97


def _logits(num_rows: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(num_rows, VOCAB, generator=torch.Generator().manual_seed(seed)) * 3


def test_repetition_penalty_matches_hf() -> None:
    from transformers.generation import logits_process as generation
    logits = _logits(3)
    histories = [[5, 7, 7, 90, 0], [], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11]]
    penalties = [1.3, 1.3, 0.7]
    ours = penalize_histories(logits.clone(), histories, penalties)
    for row in (0, 2):
        processor = generation.RepetitionPenaltyLogitsProcessor(penalties[row])
        expected = processor(torch.tensor([histories[row]]), logits[row : row + 1].clone())
        assert torch.equal(ours[row], expected[0])
    assert torch.equal(ours[1], logits[1])


def test_top_k_top_p_match_hf() -> None:
    from transformers.generation import logits_process as generation
    logits = _logits(4, seed=1)
    top_ks, top_ps = [5, 0, 20, 0], [1.0, 0.6, 0.9, 1.0]
    ours = top_k_top_p_mask(logits.clone(), top_ks, top_ps)
    for row, (k, p) in enumerate(zip(top_ks, top_ps, strict=True)):
        expected = logits[row : row + 1].clone()
        if k:
            expected = generation.TopKLogitsWarper(k)(None, expected)
        if p < 1.0:
            expected = generation.TopPLogitsWarper(p)(None, expected)
        assert torch.equal(ours[row], expected[0]), row
    assert not torch.isinf(ours[3]).any()


def test_a_shared_setting_masks_as_the_same_setting_per_row() -> None:
    # The talker passes one setting for all rows (kept a Python scalar, capturable); the runners pass one
    # per row: both are the same processors and give the same scores.
    logits = _logits(6, seed=4)
    for k, p in ((7, 1.0), (0, 0.7), (12, 0.85), (VOCAB, 1.0)):
        assert torch.equal(top_k_top_p_mask(logits, [k], [p]), top_k_top_p_mask(logits, [k] * 6, [p] * 6)), (k, p)
    mixed = top_k_top_p_mask(logits, [3, 0, 3, 0, 50, 0], [1.0, 1.0, 0.5, 0.5, 0.9, 1.0])
    assert [int(torch.isfinite(row).sum()) for row in mixed[:2]] == [3, VOCAB]


def test_race_draws_from_probs_and_survives_zero_noise() -> None:
    probs = torch.tensor([[0.0, 0.25, 0.75]]).expand(4000, -1)
    noise = torch.empty(4000, 3).exponential_(generator=torch.Generator().manual_seed(0))
    counts = torch.bincount(race(probs, noise), minlength=3).tolist()
    assert counts[0] == 0 and 0.7 < counts[2] / 4000 < 0.8
    # An exact 0 drawn as noise would make probs / noise inf or nan (0 / 0) in every row it touches.
    assert race(torch.tensor([[0.0, 1.0]]), torch.zeros(1, 2)).tolist() == [1]


def test_top_k_one_is_greedy_and_seeded_rows_ignore_the_batch() -> None:
    logits = _logits(4, seed=2)
    greedy = logits.argmax(dim=-1)
    top1 = SamplingParams(temperature=0.8, top_k=1, seed=3)
    ids = Sampler().sample(logits, ["a", "b", "c", "d"], [top1] * 4, [()] * 4)
    assert torch.equal(ids, greedy)

    seeded = SamplingParams(temperature=1.0, top_p=0.95, seed=1234)
    alone, batched = Sampler(), Sampler()
    other = SamplingParams(temperature=0.7, top_k=10)
    for step in range(20):
        row = _logits(1, seed=100 + step)
        noise = _logits(3, seed=200 + step)
        a = alone.sample(row.clone(), ["x"], [seeded], [()]).tolist()
        b = batched.sample(
            torch.cat([noise[:2], row, noise[2:]]), ["o1", "o2", "x", "o3"], [other, SamplingParams(), seeded, other],
            [()] * 4,
        ).tolist()
        assert a[0] == b[2], step
    batched.release("x")
    assert "x" not in batched.generators


def test_sampling_follows_the_distribution() -> None:
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.2] + [1e-9] * (VOCAB - 3)]))
    sampler = Sampler(seed=0)
    params = SamplingParams(temperature=1.0)
    counts = torch.zeros(VOCAB)
    for i in range(3000):
        counts[sampler.sample(logits, [f"r{i}"], [params], [()]).item()] += 1
    assert torch.allclose(counts[:3] / 3000, torch.tensor([0.5, 0.3, 0.2]), atol=0.04)


def test_a_draw_moves_no_state_until_committed() -> None:
    """A step that raised after `draw` never commits it: the rerun draws the same noise, seeds included."""
    logits = _logits(2, seed=5)
    ids, params = ["seeded", "unseeded"], [SamplingParams(temperature=1.0, seed=3), SamplingParams(temperature=1.0)]
    sampler = Sampler(seed=0)
    first = sampler.draw(logits, ids, params, [(), ()])
    assert sampler.generators == {}
    again = sampler.draw(logits, ids, params, [(), ()])
    assert torch.equal(first.token_ids, again.token_ids)
    sampler.commit(again)
    reference = Sampler(seed=0)  # NOTE: one committed step, as if the first draw had never been
    assert torch.equal(reference.sample(logits, ids, params, [(), ()]), again.token_ids)
    for _ in range(5):
        step = [sampler.sample(logits, ids, params, [(), ()]), reference.sample(logits, ids, params, [(), ()])]
        assert torch.equal(*step)


def test_forks_move_no_state_until_committed() -> None:
    """`fork` (a step that draws its own noise, as the talker does) copies what `draw` would draw from."""
    ids, seeds, cpu = ["seeded", "unseeded"], [3, None], torch.device("cpu")
    sampler, reference = Sampler(seed=0), Sampler(seed=0)
    first = [torch.empty(VOCAB).exponential_(generator=g) for _, g in sampler.fork(ids, seeds, cpu).generators]
    assert sampler.generators == {}
    forks = sampler.fork(ids, seeds, cpu)
    again = [torch.empty(VOCAB).exponential_(generator=g) for _, g in forks.generators]
    assert all(torch.equal(a, b) for a, b in zip(first, again, strict=True))
    sampler.commit(forks)
    logits, params = _logits(2, seed=6), [SamplingParams(temperature=1.0, seed=3), SamplingParams(temperature=1.0)]
    reference.sample(logits, ids, params, [(), ()])  # NOTE: one committed draw of one noise row each
    for _ in range(3):
        step = [sampler.sample(logits, ids, params, [(), ()]), reference.sample(logits, ids, params, [(), ()])]
        assert torch.equal(*step)


def _byte_level_tokenizer() -> Tokenizer:
    """Single bytes plus a few merged tokens, so multi-byte characters split across tokens."""
    spelling = bytes_to_unicode()
    vocab = {spelling[b]: b for b in range(256)}
    caf = "".join(spelling[b] for b in b"caf")
    vocab[caf] = 256
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[], fuse_unk=False))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens(["<|im_end|>"])
    return tokenizer


def test_detok_emits_only_complete_characters() -> None:
    tokenizer = _byte_level_tokenizer()
    table = token_bytes_table(tokenizer)
    assert table[256] == b"caf" and table[tokenizer.token_to_id("<|im_end|>")] == b""
    text = "café 日本 🙂!"
    ids = list(text.encode())  # one token per byte: every multi-byte character is split
    detok = Detokenizer(table)
    pieces = [detok.step("r", t) for t in ids]
    assert "".join(pieces) == text == tokenizer.decode(ids)
    assert all("\ufffd" not in p for p in pieces)
    assert pieces[3:5] == ["", "é"]  # the two bytes of é: nothing, then the character
    assert pieces[-2:] == ["🙂", "!"] and pieces[-5:-2] == ["", "", ""]
    detok.release("r")
    assert detok.step("r", 256) == "caf"


def test_detok_decode_moves_no_state_until_committed() -> None:
    detok = Detokenizer([bytes([i]) for i in range(256)])
    first, second = "é".encode()
    assert detok.step("r", first) == ""
    assert detok.decode("r", first) == Piece("\ufffd", bytes([first]))  # a lead byte after a lead byte
    piece = detok.decode("r", second)
    assert piece == Piece("é", b"") and detok.pending["r"] == bytes([first])
    detok.commit("r", piece)
    assert detok.step("r", second) == "\ufffd"
