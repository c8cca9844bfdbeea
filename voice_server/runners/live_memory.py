"""Measured activation memory: the peak of live tensor bytes that ops create while a block of code runs.

`LiveTensorBytes` is a `TorchDispatchMode`: every op's outputs pass through it, and each output whose
storage is new (not one of the op's inputs', not seen before) is counted until that storage is freed,
which a `weakref.finalize` on the storage reports (torch keeps one Python object per storage, so the
finalizer runs when the last tensor or view on it dies). What it counts: every tensor an op returns,
including the intermediates of composite ops (the math path of `scaled_dot_product_attention` runs as
separate ops through the mode). What it does not: tensors created before it started (weights, inputs),
and scratch memory a kernel allocates and frees inside one op (GEMM packing buffers, allocator slack).

It works on any device (the counts are of tensor bytes, not of an allocator), so the vision planner's
formula (`voice_server/runners/vision_plan.py`) is checked against it on CPU
(`tests/runners/test_vision_budget.py`, `loadtest/bench_vision_budget.py`).
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves


class LiveTensorBytes(TorchDispatchMode):
    """`with LiveTensorBytes() as live: ...`, then `live.peak_bytes` (and `live.num_bytes`, what is
    still alive)."""

    def __init__(self) -> None:
        super().__init__()
        self.num_bytes = 0
        self.peak_bytes = 0
        self._tracked: set[int] = set()
        """ids of the storages counted and not yet freed."""

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if torch._C._dispatch_has_kernel_for_dispatch_key(func.name(), "CompositeImplicitAutograd"):
            # NOTE: under inference_mode a composite op (scaled_dot_product_attention) reaches the mode
            # whole, and its intermediates (the math path's [heads, L, L] scores) would go unseen: run
            # its decomposition with the mode on, as make_fx does.
            with self:
                out = func.decompose(*args, **kwargs)
            if out is not NotImplemented:
                return out
        out = func(*args, **kwargs)
        inputs = {id(t.untyped_storage()) for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
        for tensor in tree_leaves(out):
            if isinstance(tensor, torch.Tensor):
                storage = tensor.untyped_storage()
                key = id(storage)
                # NOTE: a view or an in-place op's output shares an input's storage: nothing new.
                if key not in inputs and key not in self._tracked:
                    self._track(storage, key)
        return out

    def _track(self, storage: torch.UntypedStorage, key: int) -> None:
        num_bytes = storage.nbytes()
        self._tracked.add(key)
        self.num_bytes += num_bytes
        self.peak_bytes = max(self.peak_bytes, self.num_bytes)
        weakref.finalize(storage, self._release, key, num_bytes)

    def _release(self, key: int, num_bytes: int) -> None:
        self._tracked.discard(key)
        self.num_bytes -= num_bytes
