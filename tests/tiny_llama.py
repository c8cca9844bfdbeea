"""The tiny dense-decoder config the llama, quantisation and runner tests start from (each test
overrides the sizes it needs)."""

from __future__ import annotations

from typing import Any

from voice_server.models.llama import LlamaConfig

TINY_LLAMA: dict[str, Any] = {
    "vocab_size": 64, "hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8, "eos_token_ids": (3,),
}


def tiny_llama(**overrides: Any) -> LlamaConfig:
    return LlamaConfig(**{**TINY_LLAMA, **overrides})
