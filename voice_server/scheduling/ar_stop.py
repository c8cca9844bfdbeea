"""Stop conditions of one AR request, and the text it may stream so far.

Checked after each sampled token, in this order: a stop token (EOS unless `ignore_eos`, or one of
`stop_token_ids`), a stop string in the accumulated text, the speech guardrails (`max_sentences`,
`stop_repeat_len`), then `max_tokens` and `max_model_len`.

Stop strings: the output ends before the first match, which is not returned. A match may span
tokens, so the text's longest suffix that could still grow into a stop string is held back from
the stream until the next token decides it; a stream never shows text the result then drops.

With tools (`skips_tool_calls`), the speech guardrails skip tool calls, which are never spoken: a
sentence that ends inside a call does not count, nor does a token inside one (its opening tag included)
toward a repetition. Stop strings and the length limits still apply to a call's text and tokens (a call
a stop string cuts stays open; `tool_calls.py` reports it unclosed).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from voice_server.scheduling.contract import SamplingParams
from voice_server.scheduling.tool_calls import is_in_call

FINISH_STOP = "stop"
FINISH_LENGTH = "length"
_SENTENCE_END = re.compile(r"[.!?]+[\"')\]]*(?=\s)")
"""End of a sentence: its punctuation, closing quotes or brackets, then whitespace (so the end is
known one token late, and "3.5" or "e.g.x" never ends one)."""


@dataclass(frozen=True)
class StepText:
    delta: str
    """Text that became final with this token (may be "" while held back)."""
    finish_reason: str | None
    """`stop` or `length` when this token ends the request, else None."""


class StopChecker:
    def __init__(self, sampling: SamplingParams, eos_token_ids: tuple[int, ...], max_model_len: int,
                 skips_tool_calls: bool = False) -> None:
        stop_ids = set(sampling.stop_token_ids)
        if not sampling.ignore_eos:
            stop_ids.update(eos_token_ids)
        self._stop_ids = frozenset(stop_ids)
        self._stop_strings = sampling.stop
        self._max_stop_len = max((len(s) for s in sampling.stop), default=0)
        self._max_tokens = sampling.max_tokens
        self._max_model_len = max_model_len
        self._text = ""
        self._num_final_chars = 0
        """Chars of `_text` already streamed; the rest is held back."""
        self.num_output_tokens = 0
        self._max_sentences = sampling.max_sentences
        self._num_sentences = 0
        self._sentence_scan_pos = 0
        self._repeat_len = sampling.stop_repeat_len
        self._output_ids: list[int] = []
        self._seen_ngrams: set[tuple[int, ...]] = set()
        self._skips_tool_calls = skips_tool_calls

    @property
    def text(self) -> str:
        """The output text so far, held-back part included (the final text once finished)."""
        return self._text

    def append(self, token_id: int, text: str, num_seq_tokens: int) -> StepText:
        """Account for one sampled token; `num_seq_tokens` = prompt + output, this token included."""
        self.num_output_tokens += 1
        if token_id in self._stop_ids:
            # NOTE: the stop token is returned in token_ids but its text (e.g. "</s>") is not.
            return self._finish(FINISH_STOP)
        self._text += text
        match = self._find_stop()
        if match is None and self._max_sentences:
            match = self._find_sentence_limit()
        if match is not None:
            self._text = self._text[:match]
            return self._finish(FINISH_STOP)
        if self._repeat_len and not self._is_in_call(len(self._text)) and self._is_repeating(token_id):
            return self._finish(FINISH_STOP)
        if self.num_output_tokens >= self._max_tokens or num_seq_tokens >= self._max_model_len:
            return self._finish(FINISH_LENGTH)
        end = len(self._text) - self._num_held_chars()
        delta = self._text[self._num_final_chars:end]
        self._num_final_chars = end
        return StepText(delta, None)

    def _finish(self, reason: str) -> StepText:
        delta = self._text[self._num_final_chars:]
        self._num_final_chars = len(self._text)
        return StepText(delta, reason)

    def _find_stop(self) -> int | None:
        # NOTE: a match cannot start in streamed text: any suffix that was a stop-string prefix
        # was held back. So only the held-back part plus the new text is searched.
        found = [i for s in self._stop_strings if (i := self._text.find(s, self._num_final_chars)) >= 0]
        return min(found) if found else None

    def _find_sentence_limit(self) -> int | None:
        """Where the text ends after `max_sentences` sentences, once the last one is known to end."""
        for match in _SENTENCE_END.finditer(self._text, self._sentence_scan_pos):
            self._sentence_scan_pos = match.end()
            if self._is_in_call(match.start()):
                continue
            self._num_sentences += 1
            if self._num_sentences >= self._max_sentences:
                return match.end()
        return None

    def _is_in_call(self, pos: int) -> bool:
        """Position `pos` of the text is inside a tool call (only when the request has tools)."""
        return self._skips_tool_calls and is_in_call(self._text, pos)

    def _is_repeating(self, token_id: int) -> bool:
        # NOTE: small models loop ("the capital of France is Paris. The capital of France is ...");
        # a spoken reply must end rather than repeat itself until max_tokens.
        self._output_ids.append(token_id)
        if len(self._output_ids) < self._repeat_len:
            return False
        ngram = tuple(self._output_ids[-self._repeat_len:])
        if ngram in self._seen_ngrams:
            return True
        self._seen_ngrams.add(ngram)
        return False

    def _num_held_chars(self) -> int:
        """Length of the longest unstreamed suffix that is a proper prefix of a stop string."""
        num_open = len(self._text) - self._num_final_chars
        for size in range(min(num_open, self._max_stop_len - 1), 0, -1):
            tail = self._text[-size:]
            if any(s.startswith(tail) for s in self._stop_strings):
                return size
        return 0
