"""Incremental detokenisation for byte-level BPE vocabularies (GGUF `gpt2`, Llama 3, Qwen).

Every token decodes to bytes; a request keeps an incremental UTF-8 decoder, so a character split
across tokens is emitted once its last byte arrives, never as a replacement character mid-stream.
"""

from __future__ import annotations

import codecs
from typing import Any

from tokenizers import Tokenizer

from voice_server.models.llama.tokenizer import bytes_to_unicode


def token_bytes_table(tokenizer: Tokenizer) -> list[bytes]:
    """Bytes of every token id; special tokens (control, EOS) decode to nothing, as with
    `decode(skip_special_tokens=True)`."""
    unspell = {char: byte for byte, char in bytes_to_unicode().items()}
    added: dict[int, Any] = tokenizer.get_added_tokens_decoder()
    table: list[bytes] = []
    for idx in range(tokenizer.get_vocab_size(with_added_tokens=True)):
        token = added.get(idx)
        if token is not None:
            table.append(b"" if token.special else str(token.content).encode("utf-8"))
            continue
        spelled = tokenizer.id_to_token(idx)
        if spelled is None:
            table.append(b"")
        elif all(c in unspell for c in spelled):
            table.append(bytes(unspell[c] for c in spelled))
        else:
            table.append(spelled.encode("utf-8"))
    return table


class Detokenizer:
    """Per-request incremental text of sampled tokens."""

    def __init__(self, table: list[bytes]) -> None:
        self.table = table
        self.decoders: dict[str, codecs.IncrementalDecoder] = {}

    def step(self, request_id: str, token_id: int) -> str:
        """Text that `token_id` completes ("" while a character is still incomplete)."""
        decoder = self.decoders.get(request_id)
        if decoder is None:
            decoder = self.decoders[request_id] = codecs.getincrementaldecoder("utf-8")(errors="replace")
        data = self.table[token_id] if 0 <= token_id < len(self.table) else b""
        return str(decoder.decode(data, final=False))

    def release(self, request_id: str) -> None:
        self.decoders.pop(request_id, None)
