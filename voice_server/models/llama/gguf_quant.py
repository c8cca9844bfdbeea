"""Build a quantised `LlamaForCausalLM` straight from a GGUF's blocks (no fp32 model in between).

- Q4_1 linear weights -> `Int4Linear` exactly (`scale = d`, `zero = m + 8 d`) in `int4` mode; in
  `int8` and `w8a8` modes they are dequantised and requantised per row; in `w4a8` they are
  `W4A8Linear` exactly (d and m as the file's fp16), and a Q8_0 lm_head is `Q8A8Linear` exactly.
- A Q8_0 `token_embd` -> `QuantEmbedding` exactly; a tied `lm_head` is requantised from it
  (`Int8Linear` / `W8A8Linear`: per 32 -> per row; `Int4Linear`: asymmetric min/max per 32).
- Anything else (F32 norms, other block formats) is dequantised to fp32 as `gguf_weights` does.

llama.cpp's q/k row permutation is undone on the raw block rows (each row holds whole blocks).
"""

from __future__ import annotations

import torch
from torch import nn

from voice_server.models.llama.config import LlamaConfig
from voice_server.models.llama.dequant import GGML_Q4_1, GGML_Q8_0
from voice_server.models.llama.gguf_file import GGUFFile
from voice_server.models.llama.gguf_weights import gguf_to_hf_name, unpermute_qk
from voice_server.models.llama.model import LlamaForCausalLM
from voice_server.models.quant import (
    BlockA8Linear,
    Int4Linear,
    Int8Linear,
    Q8A8Linear,
    QuantEmbedding,
    W4A8Linear,
    W8A8Linear,
    check_mode,
    default_lm_head_mode,
    effective_mode,
    fuse_projections,
    quantize_head,
    quantize_linear,
)


def _quant_linear_from_gguf(raw: torch.Tensor, ggml_type: int, dense: torch.Tensor | None, mode: str) -> nn.Module:
    """`raw` uint8 rows of blocks, `dense` the fp32 values (needed unless Q4_1 -> int4)."""
    if mode == "int4" and ggml_type == GGML_Q4_1:
        return Int4Linear.from_q4_1(raw)
    if mode == "w8a8" and ggml_type == GGML_Q4_1:
        return W8A8Linear.from_q4_1(raw)
    if mode == "w4a8" and ggml_type == GGML_Q4_1:
        return W4A8Linear.from_q4_1(raw)
    if mode == "w4a8" and ggml_type == GGML_Q8_0:
        return Q8A8Linear.from_q8_0(raw)
    if mode == "w8a8" and ggml_type == GGML_Q8_0:
        return W8A8Linear.from_q8_0(raw)
    assert dense is not None
    if mode == "int8" and ggml_type == GGML_Q8_0:
        return Int8Linear.from_q8_0(raw)
    linear = nn.Linear(dense.shape[1], dense.shape[0], bias=False)
    linear.weight = nn.Parameter(dense, requires_grad=False)
    return quantize_linear(linear, mode)


@torch.no_grad()
def load_gguf_quantized(
    gguf_file: GGUFFile,
    mode: str,
    *,
    lm_head_mode: str | None = None,
    dtype: torch.dtype = torch.float32,
    fuse: bool = True,
) -> LlamaForCausalLM:
    """`mode` in int8|int4|w8a8 for every projection, `lm_head_mode` (`default_lm_head_mode`) for lm_head;
    `dtype` is the residual-stream dtype (norms, embedding output)."""
    mode = effective_mode(check_mode(mode))
    head_mode = effective_mode(check_mode(lm_head_mode or default_lm_head_mode(mode)))
    if mode == "none":
        raise ValueError("load_gguf_quantized needs a quantised mode, e.g. int4 (use load_gguf for float)")
    cfg = LlamaConfig.from_gguf_metadata(gguf_file.metadata, gguf_file.tensor_names)
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg)
    is_permuted = cfg.model_type == "llama"
    source = str(gguf_file.path)
    done: set[str] = set()
    for info in gguf_file.tensors:
        name = gguf_to_hf_name(info.name)
        module_name, _, attr = name.rpartition(".")
        is_block = info.ggml_type in (GGML_Q4_1, GGML_Q8_0)
        raw = gguf_file.raw(info)
        raw_rows = torch.from_numpy(raw.copy()) if is_block else None
        needs_dense = not (
            is_block and info.ggml_type == GGML_Q4_1 and mode in ("int4", "w8a8", "w4a8") and attr == "weight"
        )
        dense = gguf_file.dequantize(info) if needs_dense else None
        if is_permuted and (".self_attn.q_proj." in name or ".self_attn.k_proj." in name):
            heads = cfg.num_attention_heads if ".q_proj." in name else cfg.num_key_value_heads
            raw_rows = None if raw_rows is None else unpermute_qk(raw_rows, heads)
            dense = None if dense is None else unpermute_qk(dense, heads)
        target = model.get_submodule(module_name)
        if name == "model.embed_tokens.weight":
            assert dense is not None
            if info.ggml_type == GGML_Q8_0 and raw_rows is not None:
                embed: nn.Module = QuantEmbedding.from_q8_0(raw_rows, dtype)
            else:
                embed = QuantEmbedding.from_float(dense, dtype)
            model.model.embed_tokens = embed  # type: ignore[assignment]
            if cfg.tie_word_embeddings:
                model.lm_head = _head(raw_rows, info.ggml_type, dense, head_mode, dtype)  # type: ignore[assignment]
                done.add("lm_head.weight")
        elif name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        elif attr == "weight" and isinstance(target, nn.Linear):
            shape, want = tuple(reversed(info.dims)), tuple(target.weight.shape)
            if shape != want:
                raise ValueError(f"{source}: {name} has shape {shape}, expected {want}")
            module_mode = head_mode if name == "lm_head.weight" else mode
            if module_mode == "none":
                assert dense is not None
                quant: nn.Module = nn.Linear(dense.shape[1], dense.shape[0], bias=target.bias is not None)
                quant.weight = nn.Parameter(dense.to(dtype), requires_grad=False)
            else:
                assert raw_rows is not None or dense is not None
                quant = _quant_linear_from_gguf(
                    raw_rows if raw_rows is not None else torch.empty(0), info.ggml_type, dense, module_mode
                )
            # NOTE: a bias read before its weight sits on the meta nn.Linear: carry it over.
            if target.bias is not None and not target.bias.is_meta:
                quant.bias = target.bias.detach().float() if not isinstance(quant, nn.Linear) else target.bias
            _replace(model, module_name, quant)
        elif attr == "bias" and isinstance(target, Int8Linear | Int4Linear | W8A8Linear | BlockA8Linear):
            assert dense is not None
            target.bias = dense.float()
        else:
            assert dense is not None
            param = getattr(target, attr, None)
            if param is None:
                raise ValueError(f"{source}: unexpected tensor {name}")
            if tuple(dense.shape) != tuple(param.shape):
                raise ValueError(f"{source}: {name} has shape {tuple(dense.shape)}, expected {tuple(param.shape)}")
            setattr(target, attr, nn.Parameter(dense.to(dtype).contiguous(), requires_grad=False))
        done.add(name)
    missing = [n for n, p in model.named_parameters() if p.is_meta] + [
        n for n, b in model.named_buffers() if b.is_meta
    ]
    if missing:
        raise ValueError(f"{source}: missing tensors {missing[:8]} ({len(missing)} in all)")
    if fuse:
        fuse_projections(model)
    return model.eval()


def _head(
    raw_rows: torch.Tensor | None, ggml_type: int, dense: torch.Tensor, mode: str, dtype: torch.dtype
) -> nn.Module:
    if mode == "none":
        head = nn.Linear(dense.shape[1], dense.shape[0], bias=False)
        head.weight = nn.Parameter(dense.to(dtype), requires_grad=False)
        return head
    if mode == "w4a8" and not (ggml_type == GGML_Q8_0 and raw_rows is not None):
        # NOTE: a Q8_0 head is taken as it is below; any other head becomes Q8_0 blocks, never 4-bit.
        linear = nn.Linear(dense.shape[1], dense.shape[0], bias=False)
        linear.weight = nn.Parameter(dense, requires_grad=False)
        return quantize_head(linear, mode)
    return _quant_linear_from_gguf(raw_rows if raw_rows is not None else torch.empty(0), ggml_type, dense, mode)


def _replace(model: nn.Module, name: str, module: nn.Module) -> None:
    parent, _, attr = name.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, attr, module)
