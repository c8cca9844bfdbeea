"""Our C++ CPU kernels as torch custom ops (`torch.ops.voice_server.*`), compiled on first use.

`block_a8.cpp` (block-quantised linears; their activations quantised by `quantize_a8.cpp`),
`paged_attention.cpp` (decode attention over the paged KV cache) and `decoder_stack.cpp` (a w4a8
dense decoder's layers in one call per step), with their shared header `kernels.h`, are built by
`torch.utils.cpp_extension.load` into torch's extension cache (`$TORCH_EXTENSIONS_DIR`, default
`~/.cache/torch_extensions`), not the repository; later processes load the cached library (rebuilt
only when the sources, the header or the flags change). The kernels pick their vector path
(AVX512-VNNI, AVX2, scalar) from cpuid at run time, so no `-march` is needed.

Without a compiler or ninja, or with `VOICE_SERVER_NO_KERNELS=1`, `available()` is False after one
logged warning and callers use torch's own kernels.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import shutil
import sys
import time
from pathlib import Path

import torch

log = logging.getLogger(__name__)

DISABLE_ENV = "VOICE_SERVER_NO_KERNELS"
_NAME = "voice_server_kernels"
_SOURCES = tuple(Path(__file__).with_name(name) for name in ("quantize_a8.cpp", "block_a8.cpp",
                                                               "paged_attention.cpp", "decoder_stack.cpp"))
_HEADERS = (Path(__file__).with_name("kernels.h"),)
# NOTE: no FMA contraction: a fused multiply-add the compiler picks in one loop and not in another
# would make a row's bits depend on which code path computed it. -fopenmp: `at::parallel_for` is
# inline OpenMP, serial without it; compile only, not linked, so GOMP_* resolve to the libgomp torch
# already loaded (one OpenMP runtime, torch's thread count).
_CFLAGS = ("-O3", "-ffp-contract=off", "-fno-math-errno", "-fopenmp")
IMPLS = {"auto": 0, "scalar": 1, "avx2": 2, "avx512": 3}
"""`impl` argument of the ops: which vector path (auto: the best the CPU has)."""


@functools.lru_cache(maxsize=1)
def available() -> bool:
    """True once the ops are registered (built or loaded from the cache in this process)."""
    if os.environ.get(DISABLE_ENV) == "1":
        log.info("%s=1: C++ kernels off, torch's own kernels instead", DISABLE_ENV)
        return False
    if hasattr(torch.ops.voice_server, "block_a8_linear"):
        return True
    start = time.perf_counter()
    venv_bin = str(Path(sys.executable).parent)
    if shutil.which("ninja") is None and shutil.which("ninja", path=venv_bin) is not None:
        # NOTE: torch runs `ninja` from PATH; the `ninja` wheel's binary sits beside this interpreter,
        # which is not on PATH when the venv's python is run without activating the venv (`make run`).
        os.environ["PATH"] = venv_bin + os.pathsep + os.environ.get("PATH", "")
    try:
        from torch.utils.cpp_extension import load

        load(
            name=_NAME,
            sources=[str(p) for p in _SOURCES],
            extra_cflags=[*_CFLAGS, f"-DVS_HEADERS_HASH={_headers_hash()}"],
            is_python_module=False,
            verbose=False,
        )
    except Exception as exc:  # noqa: BLE001 - any build or load failure means "use torch's kernels"
        log.warning("C++ kernels unavailable (%s: %s); using torch's own kernels", type(exc).__name__,
                    str(exc).strip().splitlines()[-1] if str(exc).strip() else "")
        return False
    _register_fakes()
    log.info("C++ kernels ready in %.1f s (impl %d)", time.perf_counter() - start, best_impl())
    return True


def _headers_hash() -> str:
    """A digest of the shared header: torch rebuilds when the sources or flags change, and this puts
    the header into the flags."""
    digest = hashlib.sha256(b"".join(p.read_bytes() for p in _HEADERS))
    return digest.hexdigest()[:16]


def _register_fakes() -> None:
    """Shapes of the ops' outputs for tracing (`compile: true` exports the decode step)."""

    @torch.library.register_fake("voice_server::block_a8_linear")
    def _block_a8_linear(
        x: torch.Tensor, packed: torch.Tensor, weight_bits: int, bias: torch.Tensor | None = None,
        crest: float = -1.0, impl: int = 0,
    ) -> torch.Tensor:
        return x.new_empty(x.shape[0], packed.shape[0] * 16)

    @torch.library.register_fake("voice_server::paged_decode_attention")
    def _paged_decode_attention(
        q: torch.Tensor, k_pages: torch.Tensor, v_pages: torch.Tensor, page_index: torch.Tensor,
        seqs: torch.Tensor, scale: float, out: torch.Tensor, impl: int = 0,
    ) -> None:
        return None


def best_impl() -> int:
    """The vector path the kernels use on this CPU (a value of `IMPLS`)."""
    return int(torch.ops.voice_server.best_impl())


__all__ = ["DISABLE_ENV", "IMPLS", "available", "best_impl"]
