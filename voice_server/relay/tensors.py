"""Dtype names and zero-copy byte views for numpy arrays and torch tensors.

NOTE: torch is imported lazily: the coordinator process handles numpy only and must not pay for torch.
A torch tensor can only reach these functions if torch is already imported, so `sys.modules` tells
whether an object may be one without importing anything.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    import torch

# NOTE: numpy has no bfloat16; it travels as its raw uint16 bits and numpy users get it widened to float32
# (`from_buffer`), since bare bits read as integers and a stage would refuse them as a float array.
NUMPY_DTYPES: dict[str, np.dtype[Any]] = {
    "float64": np.dtype(np.float64),
    "float32": np.dtype(np.float32),
    "float16": np.dtype(np.float16),
    "bfloat16": np.dtype(np.uint16),
    "int64": np.dtype(np.int64),
    "int32": np.dtype(np.int32),
    "int16": np.dtype(np.int16),
    "int8": np.dtype(np.int8),
    "uint8": np.dtype(np.uint8),
    "uint16": np.dtype(np.uint16),
    "uint32": np.dtype(np.uint32),
    "uint64": np.dtype(np.uint64),
    "bool": np.dtype(np.bool_),
    "complex64": np.dtype(np.complex64),
    "complex128": np.dtype(np.complex128),
}
_NAME_BY_NUMPY: dict[np.dtype[Any], str] = {v: k for k, v in NUMPY_DTYPES.items() if k != "bfloat16"}
# Names that torch.from_numpy cannot express directly; they go through a same-size signed view.
_TORCH_VIA_SIGNED = {"bfloat16": np.dtype(np.int16), "uint16": np.dtype(np.int16),
                     "uint32": np.dtype(np.int32), "uint64": np.dtype(np.int64)}


def is_torch_tensor(x: object) -> bool:
    torch_mod = sys.modules.get("torch")
    return torch_mod is not None and isinstance(x, torch_mod.Tensor)


def dtype_name(x: np.ndarray | torch.Tensor) -> str:
    if is_torch_tensor(x):
        return str(x.dtype).removeprefix("torch.")
    assert isinstance(x, np.ndarray)
    try:
        return _NAME_BY_NUMPY[x.dtype]
    except KeyError:
        raise TypeError(f"unsupported numpy dtype {x.dtype} for the relay") from None


def numpy_dtype(name: str) -> np.dtype[Any]:
    try:
        return NUMPY_DTYPES[name]
    except KeyError:
        raise TypeError(f"unsupported relay dtype {name!r}") from None


def torch_dtype(name: str) -> torch.dtype:
    import torch

    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise TypeError(f"unsupported relay dtype {name!r} for torch")
    return dtype


def to_numpy(x: np.ndarray | torch.Tensor) -> tuple[str, np.ndarray]:
    """(dtype name, numpy view with the same strides); bfloat16 becomes its uint16 bits (the wire form). No copy
    for CPU."""
    if is_torch_tensor(x):
        import torch

        assert isinstance(x, torch.Tensor)
        name = dtype_name(x)
        t = x.detach()
        if t.device.type != "cpu":
            t = t.cpu()
        if name in _TORCH_VIA_SIGNED:
            signed = {"bfloat16": torch.int16, "uint16": torch.int16,
                      "uint32": torch.int32, "uint64": torch.int64}[name]
            return name, t.view(signed).numpy().view(NUMPY_DTYPES[name])
        numpy_dtype(name)  # NOTE: validates the name before numpy() raises a less helpful error.
        return name, t.numpy()
    if not isinstance(x, np.ndarray):
        raise TypeError(f"expected np.ndarray or torch.Tensor, got {type(x).__name__}")
    return dtype_name(x), x


def as_bytes_view(x: np.ndarray | torch.Tensor) -> tuple[str, tuple[int, ...], memoryview]:
    """(dtype name, shape, flat byte view); copies only when `x` is not C-contiguous (or not on CPU)."""
    name, arr = to_numpy(x)
    shape = tuple(int(s) for s in arr.shape)
    flat = np.ascontiguousarray(arr).reshape(-1).view(np.uint8)
    return name, shape, flat.data


def num_bytes(dtype: str, shape: Sequence[int]) -> int:
    return math.prod(shape) * numpy_dtype(dtype).itemsize


def from_buffer(
    buf: Any, dtype: str, shape: Sequence[int], as_torch: bool = False
) -> np.ndarray | torch.Tensor:
    """Zero-copy array over `buf` (anything with the buffer protocol, at least num_bytes long).

    As numpy, bfloat16 comes back widened to float32, exactly (a copy: every bfloat16 is a float32 with
    its low 16 bits zero). A read-only buffer gives a read-only numpy array; torch needs a writable one
    (it is undefined behaviour to write through a read-only view).
    """
    np_dtype = numpy_dtype(dtype)
    shape = tuple(int(s) for s in shape)
    arr = np.frombuffer(buf, dtype=np_dtype, count=math.prod(shape)).reshape(shape)
    if not as_torch:
        return (arr.astype(np.uint32) << 16).view(np.float32) if dtype == "bfloat16" else arr
    import torch

    signed = _TORCH_VIA_SIGNED.get(dtype)
    if signed is None:
        return torch.from_numpy(arr)
    return torch.from_numpy(arr.view(signed)).view(torch_dtype(dtype))
