"""Reading tensors out of request payloads: the one check for float rows handed between stages.

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
    tensor: torch.Tensor | None = None
    if isinstance(value, torch.Tensor):
        tensor = value.detach().to("cpu", copy=True)
    elif isinstance(value, np.ndarray) and value.dtype.kind == "f":
        tensor = torch.from_numpy(np.array(value, copy=True))
    if tensor is None or not tensor.is_floating_point() or tensor.ndim != 2 or tensor.shape[1] != num_cols \
            or (num_rows is not None and tensor.shape[0] != num_rows):
        want = f"[{'N' if num_rows is None else num_rows}, {num_cols}]"
        got = tuple(value.shape) if isinstance(value, torch.Tensor | np.ndarray) else type(value).__name__
        raise AdmissionError(f"{where}: must be a float array {want}, got {got}")
    if not bool(torch.isfinite(tensor).all()):
        raise AdmissionError(f"{where}: has non-finite values")
    return tensor
