"""Incremental detokenisation for byte-level BPE vocabularies (GGUF `gpt2`, Llama 3, Qwen).

Every token decodes to bytes; a request keeps the bytes of its incomplete last character, so a
character split across tokens is emitted once its last byte arrives, never as a replacement character
mid-stream. `decode` advances no state: a step keeps its pieces with `commit` once it succeeded.
"""

from __future__ import annotations

import codecs
from dataclasses import dataclass
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


@dataclass(frozen=True)
class Piece:
    """What one token adds to a request's text, and the request's state after it."""

    text: str
    """Text that the token completes ("" while a character is still incomplete)."""
    pending: bytes
    """Bytes of the character still incomplete after the token (the request's state once committed)."""


class Detokenizer:
    """Per-request incremental text of sampled tokens."""

    def __init__(self, table: list[bytes]) -> None:
        self.table = table
        self.pending: dict[str, bytes] = {}
        # NOTE: one decoder for every request: `decode` loads a request's pending bytes into it first.
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def step(self, request_id: str, token_id: int) -> str:
        """Text that `token_id` completes, committed at once."""
        piece = self.decode(request_id, token_id)
        self.commit(request_id, piece)
        return piece.text

    def decode(self, request_id: str, token_id: int) -> Piece:
        """What `token_id` adds to the request's text, leaving the request's state as it was."""
        self._decoder.setstate((self.pending.get(request_id, b""), 0))
        data = self.table[token_id] if 0 <= token_id < len(self.table) else b""
        text = str(self._decoder.decode(data, final=False))
        return Piece(text, bytes(self._decoder.getstate()[0]))

    def commit(self, request_id: str, piece: Piece) -> None:
        self.pending[request_id] = piece.pending

    def release(self, request_id: str) -> None:
        self.pending.pop(request_id, None)
