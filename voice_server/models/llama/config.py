"""Configuration of the dense decoder family (Llama / SmolLM2 / Qwen2 / Qwen3-dense).

One frozen dataclass read either from a Hugging Face `config.json` dict or from GGUF metadata.
Architecture differences are flags, not subclasses: Qwen2 has a q/k/v bias, Qwen3 a per-head q/k
RMSNorm and an explicit `head_dim`, Llama 3 a scaled RoPE.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import dataclass
from typing import Any

from voice_server.models.hf_config import HFSection, as_section, check_positive, read_head_dim, read_rope

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
        check_positive(
            self, "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
            "num_key_value_heads", "head_dim", "max_position_embeddings", integer=True,
        )
        if self.num_attention_heads % self.num_key_value_heads != 0:
            raise ValueError(
                f"LlamaConfig.num_attention_heads={self.num_attention_heads} is not a multiple of "
                f"num_key_value_heads={self.num_key_value_heads}"
            )
        if self.head_dim % 2 != 0:
            raise ValueError(f"LlamaConfig.head_dim must be even for RoPE, got {self.head_dim}")
        check_positive(self, "rms_norm_eps", "rope_theta")
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
    def from_hf_dict(cls, d: Mapping[str, Any] | HFSection) -> LlamaConfig:
        """From a parsed `config.json` of model_type llama, qwen2 or qwen3 (rules: `models/hf_config.py`)."""
        s = as_section(d, "")
        model_type = s.read_str("model_type", choices=SUPPORTED_MODEL_TYPES)
        s.read_str("hidden_act", "silu", choices=("silu",))
        hidden_size = s.read_int("hidden_size", positive=True)
        num_heads = s.read_int("num_attention_heads", positive=True)
        max_pos = s.read_int("max_position_embeddings", 2048, positive=True)
        rope = read_rope(s, 10000.0, rope_types=SUPPORTED_ROPE_TYPES)
        is_bias = s.read_bool("attention_bias", False)
        use_sliding = s.read_bool("use_sliding_window", False)
        eos = s.d.get("eos_token_id")
        eos_ids = s.read_int_tuple("eos_token_id") if isinstance(eos, list) else (
            () if eos is None else (s.read_int("eos_token_id"),)
        )
        return cls(
            vocab_size=s.read_int("vocab_size", positive=True),
            hidden_size=hidden_size,
            intermediate_size=s.read_int("intermediate_size", positive=True),
            num_hidden_layers=s.read_int("num_hidden_layers", positive=True),
            num_attention_heads=num_heads,
            num_key_value_heads=s.read_int("num_key_value_heads", num_heads, positive=True),
            head_dim=read_head_dim(s, hidden_size, num_heads),
            rms_norm_eps=s.read_float("rms_norm_eps", 1e-6, positive=True),
            rope_theta=rope.theta,
            max_position_embeddings=max_pos,
            tie_word_embeddings=s.read_bool("tie_word_embeddings", False),
            attention_bias=True if model_type == "qwen2" else is_bias,
            attention_out_bias=False if model_type == "qwen2" else is_bias,
            mlp_bias=s.read_bool("mlp_bias", False),
            qk_norm=model_type == "qwen3",
            sliding_window=s.read_opt_int("sliding_window", positive=True) if use_sliding else None,
            layer_types=s.read_str_tuple("layer_types", ()) if use_sliding else (),
            rope_type=rope.rope_type,
            rope_factor=rope.params.read_float("factor", 1.0),
            rope_low_freq_factor=rope.params.read_float("low_freq_factor", 1.0),
            rope_high_freq_factor=rope.params.read_float("high_freq_factor", 4.0),
            rope_original_max_position_embeddings=rope.params.read_int("original_max_position_embeddings", max_pos),
            model_type=model_type,
            bos_token_id=s.read_opt_int("bos_token_id"),
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
