"""Tiny GGUF files written the way llama.cpp's converter writes them, loaded by us and by transformers.

Covers what the SmolLM2 file does not: qwen2 (q/k/v bias, no q/k permutation), qwen3 (q/k norm,
explicit key_length), an untied `output.weight`, and Q4_0 / Q4_1 / Q8_0 / F16 / F32 storage.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
import torch
import transformers

from voice_server.models.llama import load_llama
from voice_server.models.llama.gguf_file import GGUFFile
from voice_server.models.llama.gguf_weights import gguf_to_hf_name, unpermute_qk

torch.set_num_threads(1)

Q = gguf.GGMLQuantizationType
HIDDEN, INTER, VOCAB, NUM_LAYERS, NUM_HEADS, NUM_KV_HEADS = 64, 96, 128, 2, 4, 2
# HF name part -> GGUF name part, and the storage type for the matrices.
_PARTS = {
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}
_QTYPES = {"attn_q": Q.Q8_0, "attn_k": Q.Q4_0, "attn_v": Q.F16, "ffn_gate": Q.Q4_1, "ffn_up": Q.Q4_1}


def _hf_name_to_gguf(name: str) -> str:
    globals_ = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output"}
    stem, suffix = name.rsplit(".", 1)
    if stem in globals_:
        return f"{globals_[stem]}.{suffix}"
    _, _, idx, part = stem.split(".", 3)
    return f"blk.{idx}.{_PARTS[part]}.{suffix}"


def _permute(w: np.ndarray, num_heads: int) -> np.ndarray:
    """llama.cpp `convert_hf_to_gguf.LlamaModel.permute` (HF half-split -> interleaved pairs)."""
    return w.reshape(num_heads, 2, w.shape[0] // num_heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _hf_model(arch: str) -> Any:
    common = dict(
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        intermediate_size=INTER,
        num_hidden_layers=NUM_LAYERS,
        num_attention_heads=NUM_HEADS,
        num_key_value_heads=NUM_KV_HEADS,
        rms_norm_eps=1e-5,
        tie_word_embeddings=arch == "llama",
        initializer_range=0.1,
    )
    # NOTE: transformers' GGUF config mapping ignores qwen3.attention.key_length and always uses
    # Qwen3Config's default head_dim of 128, so the tiny qwen3 keeps that (we do read key_length).
    extra = {"head_dim": 128} if arch == "qwen3" else {}
    names = {"llama": "Llama", "qwen2": "Qwen2", "qwen3": "Qwen3"}[arch]
    config = getattr(transformers, f"{names}Config")(**common, **extra)
    torch.manual_seed(0)
    model = getattr(transformers, f"{names}ForCausalLM")(config).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight") or name.endswith(".bias"):
                param.add_(torch.randn_like(param) * 0.1)
    return model


def _write_gguf(model: Any, arch: str, path: Path) -> dict[str, np.ndarray]:
    """Write `model` as llama.cpp would; return the dequantised HF-layout values we expect back."""
    cfg = model.config
    writer = gguf.GGUFWriter(path, arch)
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_context_length(256)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    writer.add_vocab_size(cfg.vocab_size)
    writer.add_eos_token_id(2)
    if arch == "qwen3":
        writer.add_key_length(cfg.head_dim)
        writer.add_value_length(cfg.head_dim)
    expected: dict[str, np.ndarray] = {}
    for name, tensor in model.state_dict().items():
        if cfg.tie_word_embeddings and name == "lm_head.weight":
            continue
        gguf_name = _hf_name_to_gguf(name)
        values = tensor.numpy().astype(np.float32)
        if arch == "llama" and ".attn_q." in gguf_name:
            values = _permute(values, cfg.num_attention_heads)
        elif arch == "llama" and ".attn_k." in gguf_name:
            values = _permute(values, cfg.num_key_value_heads)
        qtype = _QTYPES.get(gguf_name.split(".")[-2], Q.F32) if values.ndim == 2 else Q.F32
        if gguf_name == "token_embd.weight":
            qtype = Q.Q8_0
        stored = gguf.quants.quantize(values, qtype)
        writer.add_tensor(gguf_name, stored, raw_dtype=qtype)
        roundtrip = gguf.quants.dequantize(stored, qtype).astype(np.float32)
        expected[name] = roundtrip
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return expected


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_tiny_gguf_matches_transformers(arch: str, tmp_path: Path) -> None:
    # NOTE: transformers refuses `from_pretrained(gguf_file=...)` without accelerate (a dev dependency).
    path = tmp_path / f"tiny-{arch}.gguf"
    stored = _write_gguf(_hf_model(arch), arch, path)
    ours = load_llama(path)
    cfg = ours.config
    assert (cfg.model_type, cfg.attention_bias, cfg.qk_norm) == (arch, arch == "qwen2", arch == "qwen3")
    assert cfg.tie_word_embeddings == (arch == "llama")
    reference = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file=path.name, dtype=torch.float32)
    expected_sd = reference.eval().state_dict()
    actual_sd = ours.state_dict()
    assert set(actual_sd) == set(expected_sd)
    for name, tensor in expected_sd.items():
        assert torch.equal(actual_sd[name], tensor), name
    # And the values are the stored ones, un-permuted back to the HF layout.
    for name, values in stored.items():
        if arch == "llama" and ".q_proj." in name:
            values = unpermute_qk(torch.from_numpy(values), NUM_HEADS).numpy()
        elif arch == "llama" and ".k_proj." in name:
            values = unpermute_qk(torch.from_numpy(values), NUM_KV_HEADS).numpy()
        assert np.array_equal(actual_sd[name].numpy(), values), name
    ids = torch.randint(0, VOCAB, (1, 9), generator=torch.Generator().manual_seed(2))
    positions = torch.arange(9)[None]
    with torch.no_grad():
        err = (ours(ids, positions) - reference(ids, position_ids=positions).logits).abs().max().item()
    assert err <= 1e-4


def test_gguf_file_header(tmp_path: Path) -> None:
    path = tmp_path / "tiny.gguf"
    _write_gguf(_hf_model("qwen3"), "qwen3", path)
    parsed = GGUFFile(path)
    reader = gguf.GGUFReader(str(path))
    for key, field in reader.fields.items():
        if not key.startswith("GGUF."):
            assert parsed.metadata[key] == field.contents(), key
    assert [t.name for t in parsed.tensors] == [t.name for t in reader.tensors]
    for info, tensor in zip(parsed.tensors, reader.tensors, strict=True):
        assert np.array_equal(parsed.raw(info), tensor.data), info.name
        assert tuple(reversed(info.dims)) == tuple(int(n) for n in reversed(tensor.shape.tolist()))


def test_gguf_names() -> None:
    assert gguf_to_hf_name("blk.12.attn_q.weight") == "model.layers.12.self_attn.q_proj.weight"
    assert gguf_to_hf_name("blk.0.attn_k.bias") == "model.layers.0.self_attn.k_proj.bias"
    assert gguf_to_hf_name("output_norm.weight") == "model.norm.weight"
    assert gguf_to_hf_name("output.weight") == "lm_head.weight"
    with pytest.raises(KeyError, match="rope_freqs"):
        gguf_to_hf_name("rope_freqs.weight")
