"""Reading arrays out of request payloads: the one check for float arrays handed between stages, and for
the small integer rows and positive numbers beside them (image / video grids, seconds per frame).

Tensors arrive as numpy arrays (the relay decodes to numpy in every stage process) or as torch
tensors (a payload built in-process); either way they are checked and copied, since relayed
arrays are read-only views of shared memory that is acked when the request leaves the stage.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from voice_server.scheduling import AdmissionError


def float_rows(where: str, value: Any, num_cols: int, num_rows: int | None = None) -> torch.Tensor:
    """A float tensor [num_rows, num_cols] (any rows when None), copied to fresh CPU memory."""
    return float_array(where, value, (num_rows, num_cols))


def float_array(where: str, value: Any, shape: tuple[int | None, ...]) -> torch.Tensor:
    """A finite float tensor of `shape` (None: any size on that axis), copied to fresh CPU memory."""
    tensor: torch.Tensor | None = None
    if isinstance(value, torch.Tensor):
        tensor = value.detach().to("cpu", copy=True)
    elif isinstance(value, np.ndarray) and value.dtype.kind == "f":
        tensor = torch.from_numpy(np.array(value, copy=True))
    if tensor is None or not tensor.is_floating_point() or tensor.ndim != len(shape) \
            or any(n is not None and n != got for n, got in zip(shape, tensor.shape)):
        want = f"[{', '.join('N' if n is None else str(n) for n in shape)}]"
        got = tuple(value.shape) if isinstance(value, torch.Tensor | np.ndarray) else type(value).__name__
        raise AdmissionError(f"{where}: must be a float array {want}, got {got}")
    if not bool(torch.isfinite(tensor).all()):
        raise AdmissionError(f"{where}: has non-finite values")
    return tensor


def int_rows(where: str, value: Any, num_cols: int) -> list[list[int]]:
    """Rows of `num_cols` integers >= 1 (a list of lists, or an integer array [N, num_cols])."""
    if isinstance(value, torch.Tensor | np.ndarray):
        value = value.tolist()
    if not isinstance(value, list | tuple):
        raise AdmissionError(f"{where}: must be a list of [{num_cols} integers], got {type(value).__name__}")
    rows = []
    for i, row in enumerate(value):
        if not isinstance(row, list | tuple) or len(row) != num_cols or not all(
                isinstance(n, int) and not isinstance(n, bool) and n >= 1 for n in row):
            raise AdmissionError(f"{where}[{i}]: must be {num_cols} integers >= 1, got {row!r}"[:300])
        rows.append(list(row))
    return rows


def positive_floats(where: str, value: Any, num_values: int) -> list[float]:
    """`num_values` finite numbers > 0 (a list, or a float array [num_values])."""
    if isinstance(value, torch.Tensor | np.ndarray):
        value = value.tolist()
    if not isinstance(value, list | tuple) or len(value) != num_values:
        shown = len(value) if isinstance(value, list | tuple) else type(value).__name__
        raise AdmissionError(f"{where}: must be a list of {num_values} numbers, got {shown}")
    for number in value:
        if isinstance(number, bool) or not isinstance(number, int | float) or not (np.isfinite(number) and number > 0):
            raise AdmissionError(f"{where}: must be finite numbers > 0, got {number!r}"[:300])
    return [float(n) for n in value]
