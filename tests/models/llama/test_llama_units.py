"""Config validation, dummy weights, loader errors and the greedy driver (no reference model needed)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from tiny_llama import tiny_llama

from voice_server.models.llama import LlamaConfig, load_llama
from voice_server.models.llama.gguf_weights import unpermute_qk
from voice_server.models.llama.loader import resolve_dtype
from voice_server.runners.generate import forced_next_ids, generate_greedy

torch.set_num_threads(1)

TINY = tiny_llama()
HF_DICT = {
    "model_type": "llama",
    "vocab_size": 64,
    "hidden_size": 32,
    "intermediate_size": 48,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "tie_word_embeddings": True,
}


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("hidden_size", 0),
        ("num_key_value_heads", 3),
        ("head_dim", 7),
        ("rope_type", "yarn"),
        ("model_type", "gemma"),
        ("layer_types", ("full_attention",)),
        ("eos_token_ids", (64,)),
    ],
)
def test_config_validation_names_the_field(field: str, value: object) -> None:
    with pytest.raises(ValueError, match=field):
        dataclasses.replace(TINY, **{field: value})


def test_config_from_hf_dict_rejects_unknown() -> None:
    with pytest.raises(ValueError, match="model_type"):
        LlamaConfig.from_hf_dict({**HF_DICT, "model_type": "mistral"})
    with pytest.raises(ValueError, match="hidden_act"):
        LlamaConfig.from_hf_dict({**HF_DICT, "hidden_act": "gelu"})
    cfg = LlamaConfig.from_hf_dict({**HF_DICT, "rope_theta": 5e5, "eos_token_id": [3, 4]})
    assert (cfg.rope_theta, cfg.eos_token_ids, cfg.head_dim) == (5e5, (3, 4), 8)


def test_dummy_weights_are_seeded() -> None:
    a, b, c = (load_llama(load_format="dummy", config=TINY, seed=seed) for seed in (1, 1, 2))
    sd_a, sd_b, sd_c = a.state_dict(), b.state_dict(), c.state_dict()
    assert all(torch.equal(sd_a[k], sd_b[k]) for k in sd_a)
    assert not torch.equal(sd_a["model.layers.0.mlp.up_proj.weight"], sd_c["model.layers.0.mlp.up_proj.weight"])
    assert not any(p.is_meta for p in a.parameters())
    bf16 = load_llama(load_format="dummy", config=TINY, dtype="bf16")
    assert {p.dtype for p in bf16.parameters()} == {torch.bfloat16}
    ids = torch.tensor([[1, 2, 3]])
    assert torch.isfinite(bf16(ids, torch.arange(3)[None]).float()).all()


def test_dummy_from_directory_config(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps(HF_DICT))
    model = load_llama(tmp_path, load_format="dummy")
    assert model.config.tie_word_embeddings and model.lm_head.weight is model.model.embed_tokens.weight


def test_loader_reports_missing_and_unexpected(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps(HF_DICT))
    state = {k: v.clone() for k, v in load_llama(load_format="dummy", config=TINY).state_dict().items()}
    state.pop("lm_head.weight")  # tied in HF_DICT
    missing = dict(state)
    missing.pop("model.norm.weight")
    save_file(missing, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match=r"missing tensors \['model.norm.weight'\]"):
        load_llama(tmp_path)
    save_file({**state, "model.extra.weight": torch.zeros(2)}, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match="unexpected tensors"):
        load_llama(tmp_path)
    bad_shape = {**state, "model.norm.weight": torch.zeros(31)}
    save_file(bad_shape, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match="model.norm.weight has shape"):
        load_llama(tmp_path)


def test_resolve_dtype() -> None:
    assert resolve_dtype("bf16") is torch.bfloat16 and resolve_dtype(torch.float32) is torch.float32
    with pytest.raises(ValueError, match="dtype"):
        resolve_dtype("fp16")


def test_unpermute_inverts_llama_cpp_permute() -> None:
    w = torch.arange(4 * 8 * 3, dtype=torch.float32).reshape(4 * 8, 3)  # 4 heads of dim 8
    permuted = w.reshape(4, 2, 4, 3).transpose(1, 2).reshape(32, 3)
    assert torch.equal(unpermute_qk(permuted, 4), w)
    assert not torch.equal(permuted, w)


def test_generate_greedy_matches_full_forward_argmax_and_stops_at_eos() -> None:
    model = load_llama(load_format="dummy", config=TINY, seed=3)
    prompt = [5, 9, 11, 2]
    out = generate_greedy(model, prompt, max_new_tokens=6)
    assert len(out) == 6
    # Re-derive each token with a cache-free full forward over the growing sequence.
    seq = list(prompt)
    with torch.no_grad():
        for token in out:
            logits = model(torch.tensor([seq]), torch.arange(len(seq))[None])
            assert int(logits[0, -1].argmax()) == token
            seq.append(token)
    stopped = generate_greedy(model, prompt, max_new_tokens=6, eos_ids=[out[1]])
    assert stopped == out[: out.index(out[1]) + 1]


def test_forced_next_ids_score_position_by_position() -> None:
    model = load_llama(load_format="dummy", config=TINY, seed=3)
    prompt = [5, 9, 11, 2]
    out = generate_greedy(model, prompt, max_new_tokens=6)
    assert forced_next_ids(model, prompt, out) == out  # fed its own greedy tokens, it predicts them
    # fed other tokens, each position's argmax is the full forward's over that prefix
    other = [7, 1, 30, 2, 9, 4]
    forced = forced_next_ids(model, prompt, other)
    with torch.no_grad():
        for i, token in enumerate(forced):
            seq = prompt + other[:i]
            assert int(model(torch.tensor([seq]), torch.arange(len(seq))[None])[0, -1].argmax()) == token
    with pytest.raises(ValueError, match="must not be empty"):
        forced_next_ids(model, prompt, [])


def test_column_major_weights_keep_names_shapes_and_outputs() -> None:
    model = load_llama(load_format="dummy", config=dataclasses.replace(TINY, tie_word_embeddings=True), seed=4)
    ids, positions = torch.tensor([[1, 7, 9, 30]]), torch.arange(4)[None]
    with torch.no_grad():
        expected = model(ids, positions)
        shapes = {k: v.shape for k, v in model.state_dict().items()}
        model.use_column_major_weights()
        actual = model(ids, positions)
    weight = model.model.layers[0].mlp.up_proj.weight
    assert weight.t().is_contiguous() and not weight.is_contiguous()
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert {k: v.shape for k, v in model.state_dict().items()} == shapes
    assert (actual - expected).abs().max().item() <= 1e-5
    with pytest.raises(ValueError, match="fp32"):
        load_llama(load_format="dummy", config=TINY, dtype="bf16").use_column_major_weights()


def _tiny_tokenizer_metadata(**extra: object) -> dict[str, object]:
    from voice_server.models.llama.tokenizer import bytes_to_unicode

    special = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    tokens = special + list(bytes_to_unicode().values()) + ["he", "hel", "hell", "hello"]
    return {
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": [3, 3, 3] + [1] * (len(tokens) - 3),
        "tokenizer.ggml.merges": ["h e", "he l", "hel l", "hell o"],
        "tokenizer.ggml.bos_token_id": 1,
        "tokenizer.ggml.eos_token_id": 2,
        **extra,
    }


def test_tokenizer_from_synthetic_metadata() -> None:
    from voice_server.models.llama import GGUFTokenizer

    template = "{{ '<|im_start|>system\nBe nice.<|im_end|>\n' }}{% for m in messages %}...{% endfor %}"
    tok = GGUFTokenizer.from_gguf_metadata(_tiny_tokenizer_metadata(**{"tokenizer.chat_template": template}))
    vocab = tok.tokenizer.get_vocab()
    ids = tok.encode("hello<|im_end|>")
    assert ids == [vocab["hello"], 2]
    assert tok.decode(ids) == "hello" and tok.decode(ids, skip_special_tokens=False) == "hello<|im_end|>"
    assert tok.apply_chat_template([{"role": "user", "content": "hi"}]) == (
        "<|im_start|>system\nBe nice.<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    )
    spliced = "{{ '<|im_start|>system\n' + messages[0]['content'] + '<|im_end|>\n' }}"
    qwen_like = GGUFTokenizer.from_gguf_metadata(_tiny_tokenizer_metadata(**{"tokenizer.chat_template": spliced}))
    assert qwen_like.default_system_prompt is None
    with_bos = GGUFTokenizer.from_gguf_metadata(_tiny_tokenizer_metadata(**{"tokenizer.ggml.add_bos_token": True}))
    assert with_bos.encode("hello") == [1, vocab["hello"]]
    with pytest.raises(ValueError, match="tokenizer.ggml.model"):
        GGUFTokenizer.from_gguf_metadata(_tiny_tokenizer_metadata(**{"tokenizer.ggml.model": "llama"}))
