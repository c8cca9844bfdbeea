"""Which quantisation runs where: the modes, the per-CPU defaults and what a mode falls back to.

Apart from the quantised modules (`voice_server/models/quant_weight_only.py`, `quant_w8a8.py`,
`quant_w4a8.py`) and the model rewrite (`voice_server/models/quant.py`) because it is policy read from
this host (its CPU flags, whether our C++ kernels built), with the measurements behind each default.
"""

from __future__ import annotations

import functools
from pathlib import Path

import torch

from voice_server import kernels

QUANT_MODES = ("none", "int8", "int4", "w8a8", "w4a8")


def check_mode(mode: str) -> str:
    if mode not in QUANT_MODES:
        raise ValueError(f"quantization must be one of {QUANT_MODES}, got {mode!r}")
    return mode


@functools.lru_cache(maxsize=1)
def cpu_flags() -> frozenset[str]:
    """The `flags` of the first CPU in /proc/cpuinfo (empty where there is none, e.g. macOS)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return frozenset()
    for line in text.splitlines():
        if line.startswith("flags"):
            return frozenset(line.partition(":")[2].split())
    return frozenset()


def has_native_bf16() -> bool:
    """True where bf16 dot products run in hardware (AVX512-BF16 or AMX) and torch's kernels are
    dispatched at that level (`ATEN_CPU_CAPABILITY=avx2` makes them AVX2 even on such a CPU)."""
    capability = torch.backends.cpu.get_cpu_capability()
    return capability.startswith("AVX512") and bool(cpu_flags() & {"avx512_bf16", "amx_bf16"})


def default_quantization() -> str:
    """`w4a8` on every x86 CPU with AVX2 or better (`int4` where our C++ kernels cannot be built:
    `effective_mode`), else `none`.

    NOTE: `w4a8` (the Q4_1 blocks as they are, int8 activations per 32 with a second plane for
    outlier blocks, our C++ op) against `int4` (torch's kernel, bf16 activations), SmolLM2 through
    the runner, 1 thread, same process, EPYC with AVX512-VNNI: decode 95 vs 86 tok/s, 8 streams
    359 vs 300 tok/s, TTFT of 206 tokens 223 vs 340 ms; greedy agreement with fp32 1.0 vs 0.89 (3
    prompts) and 0.865 vs 0.78 (12 prompts). With torch's kernels at AVX2
    (`ATEN_CPU_CAPABILITY=avx2`) and our AVX2 path, all linears of a step: 5.0 vs 13.0 ms at 1 row,
    16.1 vs 26.4 ms at 8 rows. On a real AVX2-only EPYC (no AVX-512, no VNNI), 1 thread, through the
    runner (`loadtest/bench_llm.py`): decode 95.7 vs 26.3 tok/s, 8 streams 195 vs 76, TTFT of 206
    tokens 660 vs 1,345 ms (the fused layers on their AVX2 path; with the torch layers w4a8 decoded
    at 36.6 tok/s there).

    NOTE: decode is bound by reading weights, and both weight-only kernels read bf16 activations
    but convert them to fp32 in registers (a shift), so they do not need native bf16: int4 reads
    half the bytes of int8 and was fastest both natively and with `ATEN_CPU_CAPABILITY=avx2` on
    the same AVX512-BF16 EPYC (SmolLM2 decode step, 1 thread, ms: AVX512 int4 11.9 / int8 14.9 /
    fp32 37.6; AVX2 kernels int4 18.6 / int8 19.6 / fp32 38.0). Without AVX2 (ARM, old x86) stay
    on fp32: the kernels' vector paths are x86.

    NOTE: `w8a8` (int8 activations per row, `torch._int_mm`) is not the default even with
    AVX512-VNNI: on SmolLM2 its greedy agreement with fp32 is 0.54 (int4 0.86) with a first-token
    flip, from the RMSNorm-fed inputs (W8A8 on qkv alone: 0.47, gate_up alone: 0.42, o_proj 0.84,
    lm_head 0.89; outlier channels, no smoothing yet). Speed through the runner, 1 thread, same
    EPYC (AVX512-VNNI), two runs: TTFT of 206 tokens 135-141 ms vs 318-320 ms (prefill is
    compute-bound), but single-stream decode 76-78 vs 87 tok/s (int8 weights are twice int4's
    bytes and decode is bandwidth-bound once weights leave the cache), 4 streams 152-159 vs 228-229
    tok/s, 8 streams 256-257 vs 270-277 tok/s (`_int_mm`'s M>=2 GEMM is slow on cold weights).
    """
    flags = cpu_flags()
    if "avx2" in flags or "avx512f" in flags:
        return "w4a8"
    return "none"


def default_dtype() -> torch.dtype:
    """Dtype of the residual stream (norms, rope, attention) next to the quantised linears.

    fp32 everywhere: the quantised kernels take bf16 anyway, the step's non-linear work is small,
    and fp32 keeps the greedy ids closest to the fp32 model (bf16 residuals measured no faster).
    """
    return torch.float32


def default_lm_head_mode(mode: str) -> str:
    """int8 for any quantised model: lm_head is the one matrix whose error goes straight into the
    logits, and int4 (min/max per 32) of SmolLM2's tied embedding flipped the very first greedy
    token (logit error ~2 on random inputs against ~0.3 for int8); llama.cpp keeps it Q8_0 too."""
    if mode in ("w8a8", "w4a8"):
        return mode
    return "none" if mode == "none" else "int8"


def effective_mode(mode: str) -> str:
    """`mode` as it will run: `w4a8` needs the C++ kernels and is `int4` without them (no compiler,
    `VOICE_SERVER_NO_KERNELS=1`; `kernels.available()` logs why once)."""
    if mode == "w4a8" and not kernels.available():
        return "int4"
    return mode
