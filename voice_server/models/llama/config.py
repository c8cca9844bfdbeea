"""Configuration of the dense decoder family (Llama / SmolLM2 / Qwen2 / Qwen3-dense).

One frozen dataclass read either from a Hugging Face `config.json` dict or from GGUF metadata.
Architecture differences are flags, not subclasses: Qwen2 has a q/k/v bias, Qwen3 a per-head q/k
RMSNorm and an explicit `head_dim`, Llama 3 a scaled RoPE.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import dataclass
from typing import Any

SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "qwen3")
SUPPORTED_ROPE_TYPES = ("default", "llama3")
LAYER_TYPES = ("full_attention", "sliding_attention")


@dataclass(frozen=True)
class LlamaConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    # Bias on q/k/v (Qwen2 always, Llama/Qwen3 when `attention_bias`), and on o_proj (Llama/Qwen3).
    attention_bias: bool = False
    attention_out_bias: bool = False
    mlp_bias: bool = False
    # Per-head RMSNorm on q and k before RoPE (Qwen3).
    qk_norm: bool = False
    # Window of the layers whose `layer_types` entry is "sliding_attention" (Qwen2/3 option).
    sliding_window: int | None = None
    # One entry per layer from LAYER_TYPES; empty means every layer is full attention.
    layer_types: tuple[str, ...] = ()
    rope_type: str = "default"
    # Llama 3 RoPE scaling; only read when rope_type == "llama3".
    rope_factor: float = 1.0
    rope_low_freq_factor: float = 1.0
    rope_high_freq_factor: float = 4.0
    rope_original_max_position_embeddings: int = 8192
    model_type: str = "llama"
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        for name in (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_hidden_layers",
            "num_attention_heads",
            "num_key_value_heads",
            "head_dim",
            "max_position_embeddings",
        ):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"LlamaConfig.{name} must be a positive int, got {value!r}")
        if self.num_attention_heads % self.num_key_value_heads != 0:
            raise ValueError(
                f"LlamaConfig.num_attention_heads={self.num_attention_heads} is not a multiple of "
                f"num_key_value_heads={self.num_key_value_heads}"
            )
        if self.head_dim % 2 != 0:
            raise ValueError(f"LlamaConfig.head_dim must be even for RoPE, got {self.head_dim}")
        if self.rms_norm_eps <= 0:
            raise ValueError(f"LlamaConfig.rms_norm_eps must be > 0, got {self.rms_norm_eps}")
        if self.rope_theta <= 0:
            raise ValueError(f"LlamaConfig.rope_theta must be > 0, got {self.rope_theta}")
        if self.rope_type not in SUPPORTED_ROPE_TYPES:
            raise ValueError(f"LlamaConfig.rope_type={self.rope_type!r} is not one of {SUPPORTED_ROPE_TYPES}")
        if self.model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(
                f"LlamaConfig.model_type={self.model_type!r} is not one of {SUPPORTED_MODEL_TYPES}"
            )
        if self.layer_types:
            if len(self.layer_types) != self.num_hidden_layers:
                raise ValueError(
                    f"LlamaConfig.layer_types has {len(self.layer_types)} entries, "
                    f"expected num_hidden_layers={self.num_hidden_layers}"
                )
            bad = sorted(set(self.layer_types) - set(LAYER_TYPES))
            if bad:
                raise ValueError(f"LlamaConfig.layer_types has unknown entries {bad}; allowed {LAYER_TYPES}")
            if "sliding_attention" in self.layer_types and not self.sliding_window:
                raise ValueError("LlamaConfig.sliding_window must be set when a layer is 'sliding_attention'")
        if self.sliding_window is not None and self.sliding_window <= 0:
            raise ValueError(f"LlamaConfig.sliding_window must be > 0, got {self.sliding_window}")
        for token_id in self.eos_token_ids:
            if not 0 <= token_id < self.vocab_size:
                raise ValueError(f"LlamaConfig.eos_token_ids has {token_id} outside [0, {self.vocab_size})")

    def layer_sliding_window(self, layer_idx: int) -> int | None:
        if self.layer_types and self.layer_types[layer_idx] == "sliding_attention":
            return self.sliding_window
        return None

    @classmethod
    def from_hf_dict(cls, d: dict[str, Any]) -> LlamaConfig:
        """From a parsed `config.json` of model_type llama, qwen2 or qwen3."""
        model_type = d.get("model_type")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(f"config.json model_type={model_type!r} is not one of {SUPPORTED_MODEL_TYPES}")
        hidden_act = d.get("hidden_act", "silu")
        if hidden_act != "silu":
            raise ValueError(f"config.json hidden_act={hidden_act!r} is not supported (only 'silu')")
        num_heads = int(d["num_attention_heads"])
        head_dim = d.get("head_dim") or int(d["hidden_size"]) // num_heads
        # NOTE: transformers 5 writes RoPE settings under `rope_parameters`; older files use
        # `rope_theta` plus an optional `rope_scaling` dict.
        rope = dict(d.get("rope_parameters") or d.get("rope_scaling") or {})
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        rope_theta = rope.get("rope_theta", d.get("rope_theta", 10000.0))
        max_pos = int(d.get("max_position_embeddings", 2048))
        is_bias = bool(d.get("attention_bias", False))
        use_sliding = bool(d.get("use_sliding_window", False))
        layer_types = tuple(d.get("layer_types") or ()) if use_sliding else ()
        eos = d.get("eos_token_id")
        eos_ids = () if eos is None else (tuple(eos) if isinstance(eos, list) else (int(eos),))
        return cls(
            vocab_size=int(d["vocab_size"]),
            hidden_size=int(d["hidden_size"]),
            intermediate_size=int(d["intermediate_size"]),
            num_hidden_layers=int(d["num_hidden_layers"]),
            num_attention_heads=num_heads,
            num_key_value_heads=int(d.get("num_key_value_heads") or num_heads),
            head_dim=int(head_dim),
            rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
            rope_theta=float(rope_theta),
            max_position_embeddings=max_pos,
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            attention_bias=True if model_type == "qwen2" else is_bias,
            attention_out_bias=False if model_type == "qwen2" else is_bias,
            mlp_bias=bool(d.get("mlp_bias", False)),
            qk_norm=model_type == "qwen3",
            sliding_window=d.get("sliding_window") if use_sliding else None,
            layer_types=layer_types,
            rope_type=str(rope_type),
            rope_factor=float(rope.get("factor", 1.0)),
            rope_low_freq_factor=float(rope.get("low_freq_factor", 1.0)),
            rope_high_freq_factor=float(rope.get("high_freq_factor", 4.0)),
            rope_original_max_position_embeddings=int(rope.get("original_max_position_embeddings", max_pos)),
            model_type=model_type,
            bos_token_id=d.get("bos_token_id"),
            eos_token_ids=eos_ids,
        )

    @classmethod
    def from_gguf_metadata(cls, metadata: Mapping[str, Any], tensor_names: Collection[str]) -> LlamaConfig:
        """From GGUF metadata (architecture llama, qwen2 or qwen3) and the file's tensor names."""
        get = metadata.get
        arch = get("general.architecture")
        if arch not in SUPPORTED_MODEL_TYPES:
            raise ValueError(f"GGUF general.architecture={arch!r} is not one of {SUPPORTED_MODEL_TYPES}")

        def require(key: str) -> int:
            if f"{arch}.{key}" not in metadata:
                raise ValueError(f"GGUF metadata lacks {arch}.{key}")
            return int(metadata[f"{arch}.{key}"])

        num_heads = require("attention.head_count")
        hidden_size = require("embedding_length")
        head_dim = get(f"{arch}.attention.key_length") or get(f"{arch}.rope.dimension_count")
        vocab_size = get(f"{arch}.vocab_size") or len(metadata["tokenizer.ggml.tokens"])
        eos = get("tokenizer.ggml.eos_token_id")
        rope_scaling = get(f"{arch}.rope.scaling.type")
        if rope_scaling not in (None, "none"):
            raise ValueError(f"GGUF {arch}.rope.scaling.type={rope_scaling!r} is not supported")
        return cls(
            vocab_size=int(vocab_size),
            hidden_size=hidden_size,
            intermediate_size=require("feed_forward_length"),
            num_hidden_layers=require("block_count"),
            num_attention_heads=num_heads,
            num_key_value_heads=int(get(f"{arch}.attention.head_count_kv", num_heads)),
            head_dim=int(head_dim or hidden_size // num_heads),
            rms_norm_eps=float(get(f"{arch}.attention.layer_norm_rms_epsilon", 1e-6)),
            rope_theta=float(get(f"{arch}.rope.freq_base", 10000.0)),
            max_position_embeddings=int(get(f"{arch}.context_length", 2048)),
            # NOTE: llama.cpp writes `output.weight` only when it differs from the embedding.
            tie_word_embeddings="output.weight" not in tensor_names,
            attention_bias="blk.0.attn_q.bias" in tensor_names,
            attention_out_bias="blk.0.attn_output.bias" in tensor_names,
            mlp_bias="blk.0.ffn_up.bias" in tensor_names,
            qk_norm="blk.0.attn_q_norm.weight" in tensor_names,
            model_type=arch,
            bos_token_id=get("tokenizer.ggml.bos_token_id"),
            eos_token_ids=() if eos is None else (int(eos),),
        )
