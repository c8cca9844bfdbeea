"""`FusedLayers` (`voice_server/kernels/decoder_stack.cpp`): a w4a8 decoder's layers in one C++ call
per paged step, against the Python layers over the same weights and cache; batch and thread
invariance with prefill, decode and padding rows in one step; an fp16 cache; the models it leaves
to Python; bad input refused."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from tiny_llama import tiny_llama

from voice_server import kernels
from voice_server.models.llama import LlamaForCausalLM, load_llama
from voice_server.models.llama.fused import FusedLayers
from voice_server.models.paged import PagedKVCache, build_attention_context

torch.set_num_threads(1)

TINY = tiny_llama(hidden_size=64, intermediate_size=96, head_dim=16, num_hidden_layers=3, vocab_size=128,
                  eos_token_ids=())
PAGE_SIZE = 4


@pytest.fixture(scope="module", autouse=True)
def _built() -> None:
    assert kernels.available(), "the C++ kernels did not build (see the logged warning)"


def _model(seed: int = 0, **overrides: object) -> LlamaForCausalLM:
    cfg = tiny_llama(**{**TINY.__dict__, **overrides}) if overrides else TINY
    return load_llama(load_format="dummy", config=cfg, seed=seed, quantization="w4a8")


def _cache(model: LlamaForCausalLM, num_pages: int = 32, dtype: torch.dtype = torch.float32) -> PagedKVCache:
    cfg = model.config
    # NOTE: use_decode_kernel forced: the fused layers run where the decode kernel does.
    return PagedKVCache(cfg.num_hidden_layers, num_pages, PAGE_SIZE, cfg.num_key_value_heads, cfg.head_dim,
                        dtype, use_decode_kernel=True)


def _step(model: LlamaForCausalLM, cache: PagedKVCache, seqs: list[tuple[list[int], int, list[int]]],
          num_rows: int | None = None) -> torch.Tensor:
    """One forward_paged over (token ids, start position, page ids) per sequence -> logits of every real row."""
    ids = [t for tokens, _, _ in seqs for t in tokens]
    rows = len(ids) if num_rows is None else num_rows
    spans = [(start, len(tokens), pages) for tokens, start, pages in seqs]
    ctx, positions = build_attention_context(cache, spans, rows)
    input_ids = torch.tensor(ids + [0] * (rows - len(ids)))
    with torch.no_grad():
        return model.forward_paged(input_ids, positions, ctx, torch.arange(len(ids)))


def _conversation(model: LlamaForCausalLM, is_fused: bool,
                  dtype: torch.dtype = torch.float32) -> tuple[list[torch.Tensor], PagedKVCache]:
    """A prefill of 9 tokens in two chunks, then 4 decode steps; logits of every step."""
    model.is_fused = is_fused
    cache = _cache(model, dtype=dtype)
    pages = [3, 7, 1, 9]
    out = [_step(model, cache, [([5, 17, 2, 99, 40], 0, pages)]), _step(model, cache, [([8, 8, 1, 60], 5, pages)])]
    for i, token in enumerate([11, 12, 13, 14]):
        out.append(_step(model, cache, [([token], 9 + i, pages)]))
    return out, cache


def test_fused_layers_match_the_python_layers() -> None:
    model = _model()
    assert model.fused_layers() is not None
    fused, fused_cache = _conversation(model, True)
    python, python_cache = _conversation(model, False)
    for a, b in zip(fused, python, strict=True):
        # NOTE: not bit-equal (its own exp and norm sums; the int8 activation rounding amplifies an
        # ulp now and then), so within a small fraction of the logits' scale.
        assert (a - b).abs().max() <= 0.02 * b.abs().max()
        assert (a - b).abs().mean() <= 0.002 * b.abs().max()
    kv_err = (fused_cache.kv - python_cache.kv).abs().max()
    assert kv_err <= 0.02 * python_cache.kv.abs().max()


@pytest.mark.environment
def test_an_avx2_cpu_runs_them_too() -> None:
    """An AVX2-only CPU's path (its own norms, SiLU and attention) against the Python layers: here
    directly where that is the host's best path, else in a process capped to it (`ISA_ENV`)."""
    best = kernels.best_impl()
    if best < kernels.IMPLS["avx2"]:
        pytest.skip("this CPU has no AVX2 (the kernels' vector paths are x86)")
    if best == kernels.IMPLS["avx2"] or os.environ.get(kernels.ISA_ENV) == "avx2":
        return  # NOTE: the other tests of this file run the AVX2 path already
    env = {**os.environ, kernels.ISA_ENV: "avx2"}
    out = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__, "-k",
         "match_the_python_layers or alone_and_in_a_crowd or fp16_cache or thread_count"],
        env=env, cwd=Path(__file__).resolve().parents[2], capture_output=True, text=True, timeout=600)
    # NOTE: -q prints the count at the start of its line ("4 passed, 4 deselected")
    assert out.returncode == 0 and re.search(r"^4 passed\b", out.stdout, re.M), out.stdout[-3000:] + out.stderr[-2000:]


def test_qkv_bias_and_untied_head() -> None:
    model = _model(seed=2, attention_bias=True, tie_word_embeddings=False)
    assert any(name.endswith("qkv_proj.bias") for name, _ in model.named_buffers())
    fused, _ = _conversation(model, True)
    python, _ = _conversation(model, False)
    for a, b in zip(fused, python, strict=True):
        assert (a - b).abs().max() <= 0.02 * b.abs().max()


def test_a_sequence_alone_and_in_a_crowd_with_prefill_and_padding() -> None:
    model = _model(seed=1)
    alone_cache = _cache(model)
    prompt, pages = [4, 9, 33, 2, 71, 5], [2, 5]
    alone = [_step(model, alone_cache, [(prompt, 0, pages)])[-1:], _step(model, alone_cache, [([20], 6, pages)])]
    crowd_cache = _cache(model)
    # the same sequence after another's prefill, beside a decode row, then with padding rows
    _step(model, crowd_cache, [([1, 2, 3], 0, [11])])
    first = _step(model, crowd_cache, [([7] * 5, 0, [12, 13]), (prompt, 0, pages), ([6], 3, [11])])
    second = _step(model, crowd_cache, [([6], 4, [11, 14]), ([20], 6, pages)], num_rows=5)
    assert torch.equal(first[10:11], alone[0]) and torch.equal(second[1:2], alone[1])


def test_an_fp16_cache_keeps_the_logits_and_the_invariance() -> None:
    model = _model(seed=4)
    fp32, _ = _conversation(model, True)
    half, half_cache = _conversation(model, True, torch.float16)
    assert half_cache.kv.dtype == torch.float16
    for a, b in zip(half, fp32, strict=True):
        # NOTE: the fp16 rounding of keys and values, now and then amplified by the int8 activations
        assert (a - b).abs().max() <= 0.03 * b.abs().max()
        assert (a - b).abs().mean() <= 0.005 * b.abs().max()
    # the first layer's keys and values (from the embeddings alone) are the fp32 cache's rounded to fp16
    _, fp32_cache = _conversation(model, True)
    assert torch.equal(half_cache.kv[0], fp32_cache.kv[0].half())
    alone_cache = _cache(model, dtype=torch.float16)
    alone = _step(model, alone_cache, [([9, 4, 4], 0, [6])])
    crowd_cache = _cache(model, dtype=torch.float16)
    crowd = _step(model, crowd_cache, [([1, 2, 3, 4, 5], 0, [2, 3]), ([9, 4, 4], 0, [6])], num_rows=9)
    assert torch.equal(crowd[5:8], alone)
    # the torch layers cannot write an fp16 cache under fp32 activations: a clear refusal
    model.is_fused = False
    with pytest.raises(ValueError, match="only the fused C\\+\\+ layers"):
        _step(model, _cache(model, dtype=torch.float16), [([1, 2], 0, [0])])


def test_thread_count_invariant() -> None:
    model = _model(seed=3)
    one, _ = _conversation(model, True)
    torch.set_num_threads(2)
    try:
        two, _ = _conversation(model, True)
    finally:
        torch.set_num_threads(1)
    assert all(torch.equal(a, b) for a, b in zip(one, two, strict=True))


def test_models_it_leaves_to_python() -> None:
    assert FusedLayers.of(load_llama(load_format="dummy", config=TINY, quantization="int4")) is None
    assert FusedLayers.of(load_llama(load_format="dummy", config=TINY)) is None
    qk_norm = _model(qk_norm=True)
    assert qk_norm.fused_layers() is None
    off = _model()
    off.is_fused = False
    assert off.fused_layers() is None
    # NOTE: without the decode kernel the cache runs SDPA, and the Python layers with it
    model = _model()
    cfg = model.config
    cache = PagedKVCache(cfg.num_hidden_layers, 8, PAGE_SIZE, cfg.num_key_value_heads, cfg.head_dim,
                         torch.float32, use_decode_kernel=False)
    fused, _ = _conversation(model, True)
    model.is_fused = True
    assert torch.allclose(_step(model, cache, [([5, 17, 2, 99, 40], 0, [3, 7])]), fused[0], rtol=0.05, atol=0.05)


def test_bad_input_is_refused() -> None:
    model = _model()
    fused = model.fused_layers()
    assert fused is not None
    cache = _cache(model, num_pages=4)
    ctx, positions = build_attention_context(cache, [(0, 2, [1])], 2)
    cos_table, sin_table = model.signed_rope_table(torch.device("cpu"), torch.float32)
    cos, sin = cos_table[positions], sin_table[positions]
    run = torch.ops.voice_server.decoder_stack_run
    x = torch.zeros(2, TINY.hidden_size)
    with pytest.raises(RuntimeError, match="slot_mapping row 1 out of range"):
        run(fused.handle, x, cache.kv, torch.tensor([0, 10_000]), cos, sin, ctx.page_index, ctx.row_seqs)
    with pytest.raises(RuntimeError, match="row_seqs row 0 is out of range"):
        run(fused.handle, x, cache.kv, ctx.slot_mapping, cos, sin, ctx.page_index, torch.tensor([[0, 0, 99]]))
    with pytest.raises(RuntimeError, match=r"x must be contiguous fp32 \[rows, 64\]"):
        run(fused.handle, torch.zeros(2, 32), cache.kv, ctx.slot_mapping, cos, sin, ctx.page_index, ctx.row_seqs)
    with pytest.raises(RuntimeError, match="no decoder stack"):
        run(10_000, x, cache.kv, ctx.slot_mapping, cos, sin, ctx.page_index, ctx.row_seqs)
