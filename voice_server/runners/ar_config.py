"""What a `DecoderRunner` is built from: its config, the decoder's shape and the KV cache's dtype.

Apart from the step loop (`ar_runner`): stage factories check a config (`KV_CACHE_DTYPES`), offline
tools size a budget (`generate.budget_for`) and other decoders describe themselves (`DecoderShape`)
without the runner's step machinery.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from voice_server.models.llama import LlamaConfig, LlamaForCausalLM
from voice_server.models.paged import decode_kernel_usable
from voice_server.scheduling.contract import SamplingParams

KV_CACHE_DTYPES = ("auto", "model", "fp16")


@dataclass(frozen=True)
class DecoderRunnerConfig:
    budget_bytes: int
    """Memory for weights, KV cache and activations."""
    page_size: int = 16
    max_model_len: int | None = None
    """None: the model's max_position_embeddings (always capped by it and by the cache)."""
    max_step_tokens: int = 512
    """Most tokens one step computes (sizes the activation reserve)."""
    max_num_seqs: int = 8
    """Most sequences one step samples (sizes the logits part of the reserve)."""
    sampling_defaults: SamplingParams = SamplingParams()
    is_batch_invariant: bool = True
    """Pad every step's rows as the start-up probe finds row-independent (`RowPlan`), so a sequence
    gives the same logits alone and in any batch (costs single-stream decode speed). Where no padding
    does it on this CPU's BLAS the runner batches anyway, with one warning (`row_plan`)."""
    sampler_seed: int | None = None
    """Seeds the generators of requests that give no seed (None: nondeterministic)."""
    kv_cache_dtype: str = "auto"
    """`auto`: fp16 where the model's layers run as one C++ call per step (w4a8 on an AVX2 or AVX512 CPU:
    half the cache memory and half the attention's memory traffic, llama.cpp's default), else `model`;
    `model`: the residual stream's dtype; `fp16`: refused where the fused layers do not run."""
    compile: bool = False
    """Run steps of one decode row (single-stream decode) through `CompiledDecodeStep`, compiled by
    AOTInductor at start-up (~30 s; the weights are held twice, and the KV sizing counts them twice;
    inductor's cache under `inductor_cache_dir()`); other steps stay eager. Same greedy ids, but the
    logits are not always bit-identical to eager ones: a compiled runner is not batch invariant."""

    def __post_init__(self) -> None:
        for name in ("budget_bytes", "page_size", "max_step_tokens", "max_num_seqs"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"DecoderRunnerConfig.{name} must be an integer >= 1, got {value!r}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(
                f"DecoderRunnerConfig.kv_cache_dtype must be one of {KV_CACHE_DTYPES}, got {self.kv_cache_dtype!r}"
            )
        if self.max_model_len is not None and (
            isinstance(self.max_model_len, bool) or not isinstance(self.max_model_len, int) or self.max_model_len < 2
        ):
            raise ValueError(f"DecoderRunnerConfig.max_model_len must be an integer >= 2, got {self.max_model_len!r}")


def kv_cache_dtype_for(model: nn.Module, residual_dtype: torch.dtype, device: torch.device,
                       kv_cache_dtype: str = "auto", is_compiled: bool = False) -> torch.dtype:
    """The KV cache's dtype for `model` (`DecoderRunnerConfig.kv_cache_dtype`)."""
    # NOTE: only the fused layers write and read an fp16 cache under fp32 activations; a compiled
    # step reads the cache in the residual dtype.
    is_half_ok = (
        isinstance(model, LlamaForCausalLM) and not is_compiled and residual_dtype == torch.float32
        and decode_kernel_usable(torch.float16, device) and model.fused_layers() is not None
    )
    if kv_cache_dtype == "fp16" and not is_half_ok:
        raise ValueError("DecoderRunnerConfig.kv_cache_dtype: fp16 needs the fused C++ layers (a w4a8 "
                         "Llama-family model with fp32 activations on an AVX2 or AVX512 CPU, compile off)")
    return torch.float16 if is_half_ok and kv_cache_dtype != "model" else residual_dtype


@dataclass(frozen=True)
class DecoderShape:
    """What the runner needs to know of a decoder to size and run its paged KV cache."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    hidden_size: int
    intermediate_size: int
    """Widest MLP activation (sizes the activation reserve)."""
    vocab_size: int
    max_position_embeddings: int
    eos_token_ids: tuple[int, ...]

    @classmethod
    def of_llama(cls, cfg: LlamaConfig) -> DecoderShape:
        if cfg.layer_types and "sliding_attention" in cfg.layer_types:
            raise ValueError("DecoderRunner: sliding-window attention layers are not supported by the paged cache")
        return cls(cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim, cfg.hidden_size,
                   cfg.intermediate_size, cfg.vocab_size, cfg.max_position_embeddings, tuple(cfg.eos_token_ids))
