"""Our C++ CPU kernels as torch custom ops (`torch.ops.voice_server.*`), compiled on first use.

`block_a8.cpp` (block-quantised linears; their activations quantised by `quantize_a8.cpp`),
`paged_attention.cpp` (decode attention over the paged KV cache) and `decoder_stack.cpp` (a w4a8
dense decoder's layers in one call per step), with their shared header `kernels.h`, are built by
`torch.utils.cpp_extension.load` into torch's extension cache, which is per user (`$TORCH_EXTENSIONS_DIR`,
default `~/.cache/torch_extensions`), not the repository: each user (and each `$TORCH_EXTENSIONS_DIR`) builds
once, and their later processes load the cached library (rebuilt only when the sources, the header or the
flags change). The kernels pick their vector path (AVX512-VNNI, AVX2, scalar) from cpuid at run time, so no
`-march` is needed; `VOICE_SERVER_KERNEL_ISA=avx2` (or `scalar`) caps it, to run an AVX2-only CPU's path here.

Builders take turns under an flock on `<build dir>/voice_server.flock`: torch's own lock is a file
(`<build dir>/lock`) that a SIGKILLed builder leaves behind and every later one waits on forever; the
kernel drops an flock when its holder dies, so whoever holds ours knows such a file is stale and removes it.

Without a compiler or ninja, or with `VOICE_SERVER_NO_KERNELS=1`, `available()` is False after one
logged warning and callers use torch's own kernels.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import hashlib
import logging
import os
import shutil
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import torch

log = logging.getLogger(__name__)

DISABLE_ENV = "VOICE_SERVER_NO_KERNELS"
ISA_ENV = "VOICE_SERVER_KERNEL_ISA"
_NAME = "voice_server_kernels"
_FLOCK = "voice_server.flock"
"""Our build lock, in the build directory (torch's is `lock` there)."""
_ORPHAN_WAIT_S = 60.0
"""At most this long for a killed builder's compilers to finish: under a stage's `startup_timeout_s` (120 s
by default), since a process that merely sits in the build directory (a shell) never does."""
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
        from torch.utils.cpp_extension import _get_build_directory, load

        # NOTE: the directory `load` would pick (honours $TORCH_EXTENSIONS_DIR; creates it), passed to
        # it explicitly so that our lock and torch's build always share one directory.
        build_dir = _get_build_directory(_NAME, verbose=False)
        with _build_lock(build_dir):
            load(
                name=_NAME,
                sources=[str(p) for p in _SOURCES],
                extra_cflags=[*_CFLAGS, f"-DVS_HEADERS_HASH={_headers_hash()}"],
                build_directory=build_dir,
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


@contextlib.contextmanager
def _build_lock(build_dir: str) -> Iterator[None]:
    """Held while this process builds or loads the kernels; clears what a killed builder left."""
    fd = os.open(os.path.join(build_dir, _FLOCK), os.O_RDWR | os.O_CREAT, 0o600)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            log.info("waiting for another process's build of the C++ kernels in %s", build_dir)
            fcntl.flock(fd, fcntl.LOCK_EX)
        # NOTE: every voice_server builder holds our flock for as long as torch's `lock` file exists
        # (a fresh process always takes torch's lock, even to load an up-to-date build), so with the
        # flock ours that file can only be a killed builder's, and torch would wait on it forever.
        stale = os.path.join(build_dir, "lock")
        if os.path.exists(stale):
            orphans = _running_in(build_dir)
            log.warning("removing %s, left by a killed build of the C++ kernels%s", stale,
                        f" (first waiting for the {len(orphans)} processes it left running there)" if orphans else "")
            # NOTE: ninja gives each compile its own process group, so the builder's death (even with
            # its group) leaves its compilers running for tens of seconds, writing objects that ours
            # would compile and link at the same time. What they leave is safe: ninja reruns every
            # step that .ninja_log does not record as finished, partial object files included.
            deadline = time.monotonic() + _ORPHAN_WAIT_S
            while orphans and time.monotonic() < deadline:
                time.sleep(0.2)
                orphans = _running_in(build_dir)
            os.remove(stale)
        yield
    finally:
        os.close(fd)  # NOTE: closing our only descriptor releases the flock


def _running_in(build_dir: str) -> list[int]:
    """Processes (of this user; Linux) whose working directory is `build_dir`: ninja and its compilers."""
    real, pids = os.path.realpath(build_dir), []
    for pid in os.listdir("/proc") if os.path.isdir("/proc") else []:
        with contextlib.suppress(OSError):  # NOTE: gone, a zombie, or not ours
            if pid.isdigit() and os.readlink(f"/proc/{pid}/cwd") == real:
                pids.append(int(pid))
    return pids


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


__all__ = ["DISABLE_ENV", "IMPLS", "ISA_ENV", "available", "best_impl"]
