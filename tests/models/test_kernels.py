"""The C++ block-quantised linear op (`voice_server/kernels`) and its modules (`quant_w4a8.py`):
the op against a torch reference of the same math, against fp32, batch and thread invariance, the
three vector paths, packing, GGUF blocks, shapes, and the fallback without the kernels."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest
import torch
from torch import nn

from voice_server import kernels
from voice_server.models import quant_w4a8
from voice_server.models.gguf_blocks import q4_1_dequantize, q8_0_dequantize
from voice_server.models.quant import Int8Linear, fuse_linears, quantize_linear
from voice_server.models.quant_w4a8 import (
    BlockA8Linear,
    Q8A8Linear,
    W4A8Linear,
    pack_q4,
    pack_q8,
    reference_block_a8,
    unpack_q4,
    unpack_q8,
)
from voice_server.runners.row_plan import RowPlan, probe_row_plan

torch.set_num_threads(1)

CLASSES = [W4A8Linear, Q8A8Linear]
CRESTS = [-1.0, 0.0, 5.0]
"""int8 activations only (llama.cpp's Q8_1), a second plane everywhere, the default."""


@pytest.fixture(scope="module", autouse=True)
def _built() -> None:
    # NOTE: a compiler is part of the dev environment (.ci/run installs g++): a failed build here is a
    # failure, not a skip; the fallback has its own test.
    assert kernels.available(), "the C++ kernels did not build (see the logged warning)"


def _layer(cls: type[BlockA8Linear], n: int = 96, k: int = 128, with_bias: bool = True, seed: int = 0) -> BlockA8Linear:
    gen = torch.Generator().manual_seed(seed)
    weight = torch.randn(n, k, generator=gen) * 0.05
    bias = torch.randn(n, generator=gen) if with_bias else None
    return cls.from_float(weight, bias)  # type: ignore[attr-defined, no-any-return]


def _inputs(m: int, k: int, seed: int = 1) -> torch.Tensor:
    """Activations with outlier channels, like a decoder's RMSNorm outputs."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=gen)
    x[:, 3] *= 40.0
    x[:, k - 5] *= -15.0
    return x


def _op(layer: BlockA8Linear, x: torch.Tensor, crest: float, impl: str = "auto") -> torch.Tensor:
    return torch.ops.voice_server.block_a8_linear(
        x, layer.packed, layer.weight_bits, layer.bias, crest, kernels.IMPLS[impl]
    )


def _impls() -> list[str]:
    best = kernels.best_impl()
    return [name for name, value in kernels.IMPLS.items() if 0 < value <= best]


@pytest.mark.parametrize("cls", CLASSES)
@pytest.mark.parametrize("crest", CRESTS)
@pytest.mark.parametrize("with_bias", [False, True])
def test_op_matches_reference_of_the_same_math(cls: type[BlockA8Linear], crest: float, with_bias: bool) -> None:
    layer = _layer(cls, with_bias=with_bias)
    x = _inputs(7, layer.in_features)
    q, d, m = layer.unpacked()
    ref = reference_block_a8(x, q, d, m, crest)
    if layer.bias is not None:
        ref = ref + layer.bias
    for impl in _impls():
        out = _op(layer, x, crest, impl)
        # NOTE: the same quantised activations and exact integer dots; only the fp32 accumulation
        # order differs from the fp64 reference (and 8-bit two-plane dots above 2^24 round in fp32).
        assert (out - ref).abs().max() <= 1e-5 * ref.abs().max(), impl


@pytest.mark.parametrize("cls", CLASSES)
def test_op_is_close_to_fp32_linear(cls: type[BlockA8Linear]) -> None:
    layer = _layer(cls)
    x = _inputs(5, layer.in_features)
    exact = nn.functional.linear(x, layer.dequantize(), layer.bias)
    scale = exact.abs().max()
    assert (_op(layer, x, 0.0) - exact).abs().max() <= 2e-4 * scale  # ~16-bit activations
    assert (_op(layer, x, -1.0) - exact).abs().max() <= 3e-2 * scale  # int8 activations
    assert (layer(x) - exact).abs().max() <= 3e-2 * scale


@pytest.mark.parametrize("cls", CLASSES)
def test_vector_paths_give_the_same_bits(cls: type[BlockA8Linear]) -> None:
    layer = _layer(cls, n=48, k=96)
    x = _inputs(6, 96)
    for crest in CRESTS:
        outs = [_op(layer, x, crest, impl) for impl in _impls()]
        assert all(torch.equal(o, outs[0]) for o in outs[1:]), crest


@pytest.mark.parametrize("cls", CLASSES)
def test_batch_invariant(cls: type[BlockA8Linear]) -> None:
    layer = _layer(cls, n=64, k=192)
    gen = torch.Generator().manual_seed(3)
    row = _inputs(1, 192, seed=4)
    alone = layer(row)
    for m in range(2, 17):
        for pos in (0, m // 2, m - 1):
            batch = torch.randn(m, 192, generator=gen) * float(m)
            batch[pos] = row[0]
            assert torch.equal(layer(batch)[pos : pos + 1], alone), (m, pos)
    assert probe_row_plan([layer], torch.float32, 64) == (RowPlan(), "")


def test_thread_count_invariant() -> None:
    layer = _layer(W4A8Linear, n=256, k=576)
    x = _inputs(9, 576)
    try:
        outs = []
        for num_threads in (1, 2, 3):
            torch.set_num_threads(num_threads)
            outs.append(layer(x))
    finally:
        torch.set_num_threads(1)
    assert all(torch.equal(o, outs[0]) for o in outs[1:])


def test_packing_round_trips() -> None:
    gen = torch.Generator().manual_seed(6)
    q4 = torch.randint(0, 16, (32, 64), generator=gen, dtype=torch.int32)
    q8 = torch.randint(-127, 128, (32, 64), generator=gen, dtype=torch.int32)
    d = torch.rand(32, 2, generator=gen).half().float()
    m = -torch.rand(32, 2, generator=gen).half().float()
    for got, want in zip(unpack_q4(pack_q4(q4, d, m)), (q4, d, m)):
        assert torch.equal(got, want)
    for got, want in zip(unpack_q8(pack_q8(q8, d)), (q8, d)):
        assert torch.equal(got, want)


def _q4_1_rows(n: int, k: int, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    dm = (rng.random((n, k // 32, 2)) * np.array([0.01, -0.1]) + np.array([1e-3, 0.0])).astype(np.float16)
    nibbles = rng.integers(0, 256, (n, k // 32, 16), dtype=np.uint8)
    return np.concatenate([dm.view(np.uint8), nibbles], axis=-1).reshape(n, k // 32 * 20)


def _q8_0_rows(n: int, k: int, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    d = (rng.random((n, k // 32, 1)) * 0.01 + 1e-3).astype(np.float16)
    q = rng.integers(-127, 128, (n, k // 32, 32), dtype=np.int8)
    return np.concatenate([d.view(np.uint8), q.view(np.uint8)], axis=-1).reshape(n, k // 32 * 34)


def test_gguf_blocks_load_exactly() -> None:
    raw4 = _q4_1_rows(48, 128)
    assert torch.equal(W4A8Linear.from_q4_1(raw4).dequantize(), q4_1_dequantize(raw4))
    raw8 = _q8_0_rows(48, 128)
    assert torch.equal(Q8A8Linear.from_q8_0(raw8).dequantize(), q8_0_dequantize(raw8))


def test_odd_shapes_rejected() -> None:
    for shape in ((20, 64), (32, 48), (0, 32)):
        for cls in CLASSES:
            with pytest.raises(ValueError, match="w4a8 needs"):
                cls.from_float(torch.randn(*shape))  # type: ignore[attr-defined]
    with pytest.raises(ValueError, match="packed must be uint8"):
        W4A8Linear(torch.zeros(2, 3, 544, dtype=torch.uint8))
    # the model-level policy keeps such a layer on a kernel that takes any shape
    assert isinstance(quantize_linear(nn.Linear(48, 20), "w4a8"), Int8Linear)
    layer = _layer(W4A8Linear)
    with pytest.raises(RuntimeError, match="K="):
        torch.ops.voice_server.block_a8_linear(torch.randn(2, 96), layer.packed, 4, None, 5.0, 0)
    with pytest.raises(RuntimeError, match="weight_bits"):
        torch.ops.voice_server.block_a8_linear(torch.randn(2, 128), layer.packed, 3, None, 5.0, 0)


def test_fused_equals_concatenated_outputs() -> None:
    parts = [_layer(W4A8Linear, n=n, with_bias=False, seed=n) for n in (64, 16, 32)]
    fused = fuse_linears(parts)
    x = _inputs(3, 128)
    assert isinstance(fused, W4A8Linear)
    assert torch.equal(fused(x), torch.cat([p(x) for p in parts], dim=-1))


def test_torch_fallback_computes_the_same(monkeypatch: pytest.MonkeyPatch) -> None:
    layer = _layer(W4A8Linear)
    x = _inputs(4, 128)
    with_kernels = layer(x)
    monkeypatch.setattr(quant_w4a8.kernels, "available", lambda: False)
    assert (layer(x) - with_kernels).abs().max() <= 1e-5 * with_kernels.abs().max()


def test_disabled_by_env_falls_back_to_int4() -> None:
    code = (
        "from torch import nn\n"
        "from voice_server import kernels\n"
        "from voice_server.models.quant import Int4Linear, quantize_model\n"
        "assert not kernels.available()\n"
        "model = quantize_model(nn.Sequential(nn.Linear(64, 32), nn.Linear(32, 64)), 'w4a8')\n"
        "assert all(isinstance(m, Int4Linear) for m in model), model\n"
        "print('ok')\n"
    )
    env = {**os.environ, kernels.DISABLE_ENV: "1"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr


def test_isa_cap_runs_a_lesser_cpus_path() -> None:
    """VOICE_SERVER_KERNEL_ISA caps the vector path (to run an AVX2-only machine's code here); the
    paged decode kernel (and with it the fused layers) runs on AVX2 and up, not on the scalar path."""
    assert kernels.available()
    host = kernels.best_impl()
    code = (
        "from voice_server import kernels\n"
        "from voice_server.models.paged import decode_kernel_usable\n"
        "import torch\n"
        "assert kernels.available()\n"
        "print(kernels.best_impl(), decode_kernel_usable(torch.float32, torch.device('cpu')))\n"
    )
    for cap, want in (("avx2", min(host, kernels.IMPLS["avx2"])), ("scalar", kernels.IMPLS["scalar"])):
        env = {**os.environ, kernels.ISA_ENV: cap}
        out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
        assert out.returncode == 0, out.stderr
        assert out.stdout.split() == [str(want), str(want >= kernels.IMPLS["avx2"])], (cap, out.stdout)
