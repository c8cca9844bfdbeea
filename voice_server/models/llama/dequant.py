"""Vectorised torch dequantisation of the common GGUF block formats (Q4_0, Q4_1, Q8_0).

NOTE: `gguf.quants.dequantize` walks rows in small numpy chunks (about 3 s of the 4 s load of
SmolLM2-135M here); these whole-tensor torch versions do the same fp32 arithmetic in the same
order, so the values are bit-identical. Other formats fall back to `gguf.quants`.
"""

from __future__ import annotations

import numpy as np
import torch

# ggml type ids (gguf.GGMLQuantizationType): block of 32 values each.
GGML_Q4_0, GGML_Q4_1, GGML_Q8_0 = 2, 3, 8
_BLOCK_BYTES = {GGML_Q4_0: 18, GGML_Q4_1: 20, GGML_Q8_0: 34}
BLOCK_SIZE = 32


def _half(blocks: torch.Tensor, start: int) -> torch.Tensor:
    """fp16 scale stored at byte `start` of every block, as fp32 [N, 1]."""
    return blocks[:, start : start + 2].contiguous().view(torch.float16).float()


def _nibbles(packed: torch.Tensor) -> torch.Tensor:
    """[N, 16] bytes -> [N, 32]: low nibbles are values 0..15 of the block, high ones 16..31."""
    return torch.cat((packed & 0x0F, packed >> 4), dim=1)


def dequantize_blocks_torch(raw: np.ndarray, ggml_type: int) -> torch.Tensor | None:
    """fp32 values for `raw` uint8 blocks [..., row_bytes]; None when the type is not handled."""
    block_bytes = _BLOCK_BYTES.get(ggml_type)
    if block_bytes is None:
        return None
    shape = (*raw.shape[:-1], raw.shape[-1] // block_bytes * BLOCK_SIZE)
    blocks = torch.from_numpy(np.array(raw, dtype=np.uint8)).reshape(-1, block_bytes)
    d = _half(blocks, 0)
    if ggml_type == GGML_Q8_0:
        values = blocks[:, 2:].contiguous().view(torch.int8).float() * d
    elif ggml_type == GGML_Q4_1:
        values = d * _nibbles(blocks[:, 4:]).float() + _half(blocks, 2)
    else:
        values = d * (_nibbles(blocks[:, 2:]).to(torch.int8) - 8).float()
    return values.reshape(shape)
