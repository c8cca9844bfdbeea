"""Dense Llama-family decoder (Llama / SmolLM2 / Qwen2 / Qwen3-dense): HF safetensors and GGUF."""

from __future__ import annotations

from voice_server.models.llama.config import LlamaConfig
from voice_server.models.llama.loader import find_smollm2_gguf, load_gguf_with_tokenizer, load_llama
from voice_server.models.llama.model import LlamaForCausalLM
from voice_server.models.llama.tokenizer import GGUFTokenizer

__all__ = [
    "GGUFTokenizer",
    "LlamaConfig",
    "LlamaForCausalLM",
    "find_smollm2_gguf",
    "load_gguf_with_tokenizer",
    "load_llama",
]
