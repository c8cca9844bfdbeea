"""Tiny seeded Llama / Qwen2 / Qwen3 checkpoints saved by transformers, loaded by our loader."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import transformers

from voice_server.models.llama import LlamaForCausalLM, load_llama
from voice_server.models.llama.loader import read_hf_config

torch.set_num_threads(1)

_BASE = dict(
    vocab_size=128,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    # NOTE: larger than HF's 0.02 so attention is peaked and a RoPE/mask/bias error moves the logits.
    initializer_range=0.1,
)
CASES: dict[str, tuple[str, dict[str, Any]]] = {
    "llama": ("LlamaConfig", {}),
    # Llama 3 RoPE scaling, tied embeddings and every optional bias.
    "llama3_tied_bias": (
        "LlamaConfig",
        {
            "tie_word_embeddings": True,
            "attention_bias": True,
            "mlp_bias": True,
            "rope_parameters": {
                "rope_type": "llama3",
                "rope_theta": 500000.0,
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 16,
            },
        },
    ),
    "qwen2": ("Qwen2Config", {}),
    # Second layer uses a 4-token window; the test sequence is longer than that.
    "qwen2_sliding": ("Qwen2Config", {"use_sliding_window": True, "sliding_window": 4, "max_window_layers": 1}),
    "qwen3": ("Qwen3Config", {"head_dim": 32}),
}
SEQ_LEN = 11


def _hf_model(case: str) -> Any:
    config_cls, extra = CASES[case]
    config = getattr(transformers, config_cls)(**_BASE, **extra)
    torch.manual_seed(0)
    model = getattr(transformers, config_cls.replace("Config", "ForCausalLM"))(config).eval()
    # NOTE: HF initialises norms to exactly 1 and biases to 0; perturb them so a missing or
    # misnamed tensor cannot hide behind the default value.
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight") or name.endswith(".bias"):
                param.add_(torch.randn_like(param) * 0.1)
    return model


def _ids(batch: int = 2) -> torch.Tensor:
    return torch.randint(0, _BASE["vocab_size"], (batch, SEQ_LEN), generator=torch.Generator().manual_seed(1))


@pytest.fixture(scope="module", params=list(CASES))
def pair(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, LlamaForCausalLM]:
    hf = _hf_model(request.param)
    directory = tmp_path_factory.mktemp(request.param)
    hf.save_pretrained(directory)
    return hf, load_llama(directory)


def test_full_forward_matches_transformers(pair: tuple[Any, LlamaForCausalLM]) -> None:
    hf, ours = pair
    ids = _ids()
    positions = torch.arange(SEQ_LEN)[None].expand(2, -1)
    with torch.no_grad():
        expected = hf(ids, position_ids=positions).logits
        actual = ours(ids, positions)
    assert actual.shape == (2, SEQ_LEN, _BASE["vocab_size"])
    assert (actual - expected).abs().max().item() <= 1e-4


def test_incremental_decode_matches_full_forward(pair: tuple[Any, LlamaForCausalLM]) -> None:
    _, ours = pair
    ids = _ids()
    positions = torch.arange(SEQ_LEN)[None].expand(2, -1)
    with torch.no_grad():
        full = ours(ids, positions)
        cache = ours.make_kv_cache()
        # prefill 5, a 3-token chunk, then single tokens
        steps = [(0, 5), (5, 8)] + [(i, i + 1) for i in range(8, SEQ_LEN)]
        parts = [ours(ids[:, a:b], positions[:, a:b], cache) for a, b in steps]
        chunked = ours.make_kv_cache()
        ours(ids[:, :6], positions[:, :6], chunked)
        last = ours(ids[:, 6:], positions[:, 6:], chunked, is_last_only=True)
    assert cache.seq_len == SEQ_LEN
    assert (torch.cat(parts, dim=1) - full).abs().max().item() <= 1e-5
    assert last.shape == (2, 1, _BASE["vocab_size"])
    assert (last[:, 0] - full[:, -1]).abs().max().item() <= 1e-5


def test_tied_embeddings_share_storage(pair: tuple[Any, LlamaForCausalLM]) -> None:
    hf, ours = pair
    is_tied = ours.config.tie_word_embeddings
    assert is_tied == bool(hf.config.tie_word_embeddings)
    assert (ours.lm_head.weight is ours.model.embed_tokens.weight) == is_tied
    assert not any(p.is_meta for p in ours.parameters())
    assert set(ours.state_dict()) == set(hf.state_dict())


def test_sharded_checkpoint_and_bf16(tmp_path: Path) -> None:
    hf = _hf_model("qwen3")
    hf.save_pretrained(tmp_path, max_shard_size="40KB")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    assert len(list(tmp_path.glob("model-*.safetensors"))) > 1
    ours = load_llama(tmp_path, dtype="bf16")
    assert {p.dtype for p in ours.parameters()} == {torch.bfloat16}
    ids = _ids(1)
    positions = torch.arange(SEQ_LEN)[None]
    with torch.no_grad():
        expected = hf(ids, position_ids=positions).logits
        actual = ours(ids, positions).float()
    # bf16 weights and activations: loose bound, but a wrong layer would be off by O(1).
    assert (actual - expected).abs().max().item() <= 5e-2


def test_config_from_hf_dict_fields(tmp_path: Path) -> None:
    hf = _hf_model("qwen2_sliding")
    hf.save_pretrained(tmp_path)
    cfg = read_hf_config(tmp_path)
    assert (cfg.model_type, cfg.attention_bias, cfg.attention_out_bias, cfg.qk_norm) == ("qwen2", True, False, False)
    assert cfg.layer_types == ("full_attention", "sliding_attention")
    assert cfg.layer_sliding_window(0) is None and cfg.layer_sliding_window(1) == 4
