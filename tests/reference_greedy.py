"""A contiguous-cache greedy loop over `LlamaForCausalLM.forward`: the test-only reference the paged
runner is checked against (the product's one generation loop is `voice_server.runners.generate`)."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from voice_server.models.llama.model import LlamaForCausalLM


@torch.inference_mode()
def greedy_contiguous(
    model: LlamaForCausalLM,
    input_ids: Sequence[int] | torch.Tensor,
    max_new_tokens: int,
    eos_ids: Sequence[int] = (),
) -> list[int]:
    """New token ids (prompt excluded) for one sequence; stops after the first eos id."""
    if max_new_tokens <= 0:
        raise ValueError(f"max_new_tokens must be > 0, got {max_new_tokens}")
    ids = torch.as_tensor(input_ids, dtype=torch.long).reshape(1, -1)
    if ids.shape[1] == 0:
        raise ValueError("input_ids must not be empty")
    device = next(model.parameters()).device
    ids = ids.to(device)
    kv_cache = model.make_kv_cache()
    positions = torch.arange(ids.shape[1], device=device)[None]
    eos = set(eos_ids)
    out: list[int] = []
    for _ in range(max_new_tokens):
        logits = model(ids, positions, kv_cache, is_last_only=True)
        token = int(logits[0, -1].argmax())
        out.append(token)
        if token in eos:
            break
        positions = positions[:, -1:] + 1
        ids = torch.tensor([[token]], device=device)
    return out
