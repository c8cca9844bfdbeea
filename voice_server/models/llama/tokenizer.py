"""Byte-level BPE tokenizer and ChatML prompt built from GGUF metadata (no hub download).

Built the way transformers builds it from the same GGUF (`integrations/gguf/gguf_tokenizer_mapping.py`):
tokens outside the byte alphabet are respelled, control tokens become special added tokens, and
the pre-tokenizer split follows `tokenizer.ggml.pre` (GPT-2's regex when the name is not known).
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers

from voice_server.models.chat_tools import Tool, chat_turns

_TOKEN_TYPE_CONTROL = 3
_TOKEN_TYPE_USER_DEFINED = 4
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
PRE_TOKENIZER_SPLITS = {
    "llama3": _LLAMA3_SPLIT,
    "llama-v3": _LLAMA3_SPLIT,
    "llama-bpe": _LLAMA3_SPLIT,
    "smaug-bpe": _LLAMA3_SPLIT,
    "qwen2": _QWEN2_SPLIT,
    "deepseek-r1-qwen": _QWEN2_SPLIT,
}
# A literal default system prompt in a ChatML template (no quotes or jinja inside, so a template
# that splices in `messages[0]['content']` does not match).
_SYSTEM_DEFAULT_RE = re.compile(r"<\|im_start\|>system\n([^'\"{}]*?)<\|im_end\|>")


@lru_cache(maxsize=1)
def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character table."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
    printable += list(range(ord("®"), ord("ÿ") + 1))
    chars = list(printable)
    extra = 0
    for byte in range(256):
        if byte not in printable:
            printable.append(byte)
            chars.append(256 + extra)
            extra += 1
    return {byte: chr(c) for byte, c in zip(printable, chars, strict=True)}


def build_tokenizer(
    tokens: Sequence[str],
    merges: Sequence[str],
    token_types: Sequence[int],
    pre: str | None,
    special_ids: Sequence[int] = (),
) -> Tokenizer:
    """A `tokenizers.Tokenizer` for a GGUF `gpt2` (byte-level BPE) vocabulary."""
    spelling = bytes_to_unicode()
    alphabet = set(spelling.values())
    vocab = {
        token if set(token) <= alphabet else "".join(spelling[b] for b in token.encode("utf-8")): idx
        for idx, token in enumerate(tokens)
    }
    pairs = [_merge_pair(merge) for merge in merges]
    tokenizer = Tokenizer(
        models.BPE(
            vocab=vocab,
            merges=pairs,
            dropout=None,
            continuing_subword_prefix="",
            end_of_word_suffix="",
            fuse_unk=False,
        )
    )
    split = PRE_TOKENIZER_SPLITS.get(pre or "")
    if split is None:
        tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    else:
        tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(split), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    tokenizer.decoder = decoders.ByteLevel()
    # NOTE: a control token spelled outside the byte alphabet is a llama.cpp mislabel; adding it
    # would grow the vocabulary (transformers skips it too).
    special = [
        idx
        for idx, kind in enumerate(token_types)
        if kind == _TOKEN_TYPE_CONTROL and set(tokens[idx]) <= alphabet
    ]
    special += [idx for idx in special_ids if idx not in special]
    tokenizer.add_special_tokens([AddedToken(tokens[idx], normalized=False, special=True) for idx in special])
    user_defined = [idx for idx, kind in enumerate(token_types) if kind == _TOKEN_TYPE_USER_DEFINED]
    tokenizer.add_tokens([AddedToken(tokens[idx], normalized=False, special=False) for idx in user_defined])
    return tokenizer


def _merge_pair(merge: str) -> tuple[str, str]:
    left, _, right = merge.partition(" ")
    return left, right


@dataclass
class GGUFTokenizer:
    """Tokenizer plus the chat conventions the GGUF declares."""

    tokenizer: Tokenizer
    bos_token_id: int | None
    eos_token_id: int | None
    chat_template: str | None
    # System prompt the template inserts when the conversation has none (SmolLM2 does).
    default_system_prompt: str | None
    is_add_bos: bool = False

    @classmethod
    def from_gguf_metadata(cls, metadata: Mapping[str, Any]) -> GGUFTokenizer:
        get = metadata.get

        kind = get("tokenizer.ggml.model")
        if kind != "gpt2":
            raise ValueError(f"GGUF tokenizer.ggml.model={kind!r} is not supported (only byte-level 'gpt2')")
        tokens: list[str] = metadata["tokenizer.ggml.tokens"]
        special_keys = ("bos_token_id", "eos_token_id", "unknown_token_id", "padding_token_id")
        special_ids = [int(v) for v in (get(f"tokenizer.ggml.{k}") for k in special_keys) if v is not None]
        tokenizer = build_tokenizer(
            tokens,
            get("tokenizer.ggml.merges") or [],
            get("tokenizer.ggml.token_type") or [],
            get("tokenizer.ggml.pre"),
            special_ids,
        )
        template = get("tokenizer.chat_template")
        match = _SYSTEM_DEFAULT_RE.search(template or "")
        return cls(
            tokenizer=tokenizer,
            bos_token_id=get("tokenizer.ggml.bos_token_id"),
            eos_token_id=get("tokenizer.ggml.eos_token_id"),
            chat_template=template,
            default_system_prompt=match.group(1) if match else None,
            is_add_bos=bool(get("tokenizer.ggml.add_bos_token", False)),
        )

    def encode(self, text: str) -> list[int]:
        # NOTE: SmolLM2's GGUF says add_bos_token=False: its chat template writes the markers.
        ids = list(self.tokenizer.encode(text, add_special_tokens=False).ids)
        return [self.bos_token_id, *ids] if self.is_add_bos and self.bos_token_id is not None else ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return str(self.tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens))

    def apply_chat_template(
        self,
        messages: Sequence[Mapping[str, Any]],
        add_generation_prompt: bool = True,
        *,
        tools: Sequence[Tool] = (),
    ) -> str:
        """ChatML (`<|im_start|>role\\ncontent<|im_end|>\\n`), as SmolLM2's template renders it; tools, calls and
        their results the Hermes way Qwen's templates write them (`models/chat_tools.py`)."""
        if self.chat_template is not None and "<|im_start|>" not in self.chat_template:
            raise ValueError("only ChatML chat templates are supported")
        turns = chat_turns(messages, tools, self.default_system_prompt)
        parts = [f"<|im_start|>{turn.role}\n{turn.text}<|im_end|>\n" for turn in turns]
        if add_generation_prompt:
            parts.append("<|im_start|>assistant\n")
        return "".join(parts)

    def encode_chat(
        self,
        messages: Sequence[Mapping[str, Any]],
        add_generation_prompt: bool = True,
        *,
        tools: Sequence[Tool] = (),
    ) -> list[int]:
        return self.encode(self.apply_chat_template(messages, add_generation_prompt, tools=tools))
