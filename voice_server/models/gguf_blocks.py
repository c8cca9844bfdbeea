"""GGUF block formats as torch tensors (shared by the quantised linears and embeddings)."""

from __future__ import annotations

import torch

GROUP_SIZE = 32
"""Values per GGUF Q8_0 / Q4_1 block (and the int4 group size)."""
_Q8_0_BLOCK_BYTES, _Q4_1_BLOCK_BYTES = 34, 20


def _as_uint8_rows(raw: object) -> torch.Tensor:
    """GGUF blocks (numpy or torch uint8 [N, row_bytes]) as a torch uint8 tensor."""
    if isinstance(raw, torch.Tensor):
        return raw.to(torch.uint8)
    import numpy as np

    return torch.from_numpy(np.array(raw, dtype=np.uint8))


def q4_1_unpack(raw: object) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """GGUF Q4_1 rows [N, K // 32 * 20] -> (q int32 [N, K] in 0..15, d fp32 [N, K//32], m fp32 [N, K//32])."""
    rows = _as_uint8_rows(raw)
    n = rows.shape[0]
    blocks = rows.reshape(n, -1, _Q4_1_BLOCK_BYTES)
    d = blocks[..., 0:2].contiguous().view(torch.float16).float().squeeze(-1)
    m = blocks[..., 2:4].contiguous().view(torch.float16).float().squeeze(-1)
    packed = blocks[..., 4:]
    q = torch.cat((packed & 0x0F, packed >> 4), dim=-1).to(torch.int32)
    return q.reshape(n, -1), d, m


def q8_0_unpack(raw: object) -> tuple[torch.Tensor, torch.Tensor]:
    """GGUF Q8_0 rows [N, K // 32 * 34] -> (q int8 [N, K], d fp32 [N, K // 32])."""
    rows = _as_uint8_rows(raw)
    n = rows.shape[0]
    blocks = rows.reshape(n, -1, _Q8_0_BLOCK_BYTES)
    d = blocks[..., 0:2].contiguous().view(torch.float16).float().squeeze(-1)
    q = blocks[..., 2:].contiguous().view(torch.int8)
    return q.reshape(n, -1), d


def q4_1_dequantize(raw: object) -> torch.Tensor:
    """GGUF Q4_1 rows -> fp32 [N, K] (`d * q + m` per block of 32)."""
    q, d, m = q4_1_unpack(raw)
    n = q.shape[0]
    return (q.float().reshape(n, -1, GROUP_SIZE) * d[..., None] + m[..., None]).reshape(n, -1)


def q8_0_dequantize(raw: object) -> torch.Tensor:
    """GGUF Q8_0 rows -> fp32 [N, K] (`d * q` per block of 32)."""
    q, d = q8_0_unpack(raw)
    n = q.shape[0]
    return (q.float().reshape(n, -1, GROUP_SIZE) * d[..., None]).reshape(n, -1)


__all__ = ["GROUP_SIZE", "q4_1_dequantize", "q4_1_unpack", "q8_0_dequantize", "q8_0_unpack"]
