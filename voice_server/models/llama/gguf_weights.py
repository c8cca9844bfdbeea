"""GGUF (llama.cpp) tensors -> our parameter names, dequantised to torch.

llama.cpp's converter permutes the rows of q/k of `llama` files into an interleaved-pair RoPE
layout; `unpermute_qk` undoes it exactly as transformers' GGUF loader does, so the weights equal
transformers' and the model keeps the half-split RoPE of `voice_server.models.layers`.
"""

from __future__ import annotations

import re
from collections.abc import Iterator

import torch

from voice_server.models.llama.config import LlamaConfig
from voice_server.models.llama.gguf_file import GGUFFile

_GLOBAL_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
_BLOCK_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_BLOCK_RE = re.compile(r"^blk\.(\d+)\.([a-z_]+)\.(weight|bias)$")
_GLOBAL_RE = re.compile(r"^([a-z_]+)\.(weight|bias)$")


def gguf_to_hf_name(gguf_name: str) -> str:
    """`blk.3.attn_q.weight` -> `model.layers.3.self_attn.q_proj.weight`; KeyError if unknown."""
    match = _BLOCK_RE.match(gguf_name)
    if match is not None:
        idx, part, suffix = match.groups()
        if part in _BLOCK_NAMES:
            return f"model.layers.{idx}.{_BLOCK_NAMES[part]}.{suffix}"
    match = _GLOBAL_RE.match(gguf_name)
    if match is not None and match.group(1) in _GLOBAL_NAMES:
        return f"{_GLOBAL_NAMES[match.group(1)]}.{match.group(2)}"
    raise KeyError(f"GGUF tensor {gguf_name!r} has no counterpart in the dense decoder")


def unpermute_qk(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Rows [num_heads * head_dim, ...] from llama.cpp's interleaved-pair order back to HF's
    half-split order (inverse of `convert_hf_to_gguf.LlamaModel.permute`)."""
    half = weight.shape[0] // num_heads // 2
    w = weight.reshape(num_heads, half, 2, *weight.shape[1:])
    return w.transpose(1, 2).reshape(weight.shape)


def iter_gguf_tensors(gguf_file: GGUFFile, cfg: LlamaConfig) -> Iterator[tuple[str, torch.Tensor]]:
    """(our name, fp32 tensor) per GGUF tensor, dequantised one at a time."""
    # NOTE: llama.cpp permutes q/k only for the `llama` architecture (qwen2/qwen3 are stored as is).
    is_permuted = cfg.model_type == "llama"
    for info in gguf_file.tensors:
        name = gguf_to_hf_name(info.name)
        values = gguf_file.dequantize(info)
        if is_permuted and ".self_attn.q_proj." in name:
            values = unpermute_qk(values, cfg.num_attention_heads)
        elif is_permuted and ".self_attn.k_proj." in name:
            values = unpermute_qk(values, cfg.num_key_value_heads)
        yield name, values
