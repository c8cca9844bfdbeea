"""Tool calls cut out of a text LLM's streamed output: a call is never spoken, it reaches the client as a call.

On when a request has `params["tools"]` (a non-empty list; `ar_input.read_tools` checks it); otherwise
nothing here runs and the stream is as it always was. One format for now, Hermes' (the Qwen family's):
a call is `<tool_call>` ... `</tool_call>` in the output text, its raw text the inner text stripped of
surrounding whitespace (JSON like {"name": ..., "arguments": {...}}, parsed and checked by the session,
not here).

Two layers, each with explicit streaming state:
- `ToolCallFilter`, on text: `feed(delta)` gives the text that became plain and the calls that closed;
  `finish()` the rest. A suffix that is a proper prefix of `<tool_call>` is held until the next delta
  decides it ("a < b" is text once " b" arrives), and an open call is held until it closes, so nothing
  of a call ever streams, not even its `<`. Whitespace right after a call's close is dropped (between
  two calls, or before the text that follows), and a token of that whitespace alone is dropped like a call's.
  At `finish()` a held prefix is text and an unclosed call
  is reported as its raw text after its opening tag (the session refuses it as malformed).
- `ToolCallGate`, on a request's STREAM emits (`ARScheduler._on_sample`): it feeds the filter the text
  the `StopChecker` released (so stop strings cut first; the guardrails skip calls themselves, see
  `ar_stop.py`) and holds each token's whole emit (token ids and the runner's data, e.g. the thinker's
  talker feed) while any of the token's text is undecided. A decided token is dropped if any of its
  characters is part of a call (tags included), else released; emits go out in token order. Qwen's tags
  are single tokens, so a boundary falls between tokens; a token that straddles one (a split tag after
  text, "Hi <") is dropped whole, its text still streams.

What the emits carry, so the stream stays exactly what RESULT says:
- "text": a released emit carries all text released since the previous released emit (not only its
  own token's: a dropped token may have released some, and text never travels without a token, as
  every chunk a talker receives must carry its feed). Concatenated it equals RESULT's "text".
- "tool_calls": [raw, ...] on the emit released in the step that closed them, or, when that step's own
  token was dropped (the closing tag), on the next released one, at the latest the request's last.
- The request's last token (EOS, stop, or the one that hit a length limit, maybe inside a call) is always
  released: downstream stages take a request's last token as its end and never speak it (the talker
  feed), so dropping it would cut the last spoken token instead.
- Data a dropped token carried that the next released token lacks is carried over to it (a mapping is
  merged under the released one's, whose entries win): one-off data, like the talker's prompt that rides
  on the first token, must arrive even when the reply opens with a call; per-token data is overwritten.
- RESULT's "text" is the plain text (calls excluded) and its "tool_calls" every raw call of the request.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass
from typing import Any

OPEN_TAG = "<tool_call>"
CLOSE_TAG = "</tool_call>"
_PER_TOKEN_KEYS = ("token_ids", "text")
"""Keys of a STREAM payload that belong to its token alone (never carried over from a dropped token)."""


@dataclass(frozen=True)
class ToolStep:
    text: str
    """Text that became plain (to stream)."""
    calls: tuple[str, ...] = ()
    """Raw text of each call that closed (or, at `finish`, was left open), in order."""


@dataclass(frozen=True)
class CallSpan:
    """Where a call lies in the filter's input: from its opening tag's `<` to past its closing tag's `>`."""

    start: int
    end: int | None
    """None while the call is open (and for good if it never closes)."""

    def overlaps(self, start: int, end: int) -> bool:
        """Whether input [start, end) has a character of this call; an empty range (a token with no text)
        counts when strictly inside it."""
        limit = math.inf if self.end is None else self.end
        return self.start < start < limit if start == end else start < limit and end > self.start


class ToolCallFilter:
    """Cuts tool calls out of streamed text (see the module docstring)."""

    def __init__(self) -> None:
        self._pending = ""
        """Undecided input, a suffix of what was fed: outside a call a proper prefix of `OPEN_TAG`, inside
        one the call's text so far."""
        self._is_in_call = False
        self._is_after_call = False
        """A call just closed: the whitespace that follows is dropped."""
        self.num_fed_chars = 0
        self.spans: list[CallSpan] = []
        """Every call so far, in order: which tokens to drop (`ToolCallGate`)."""
        self.blanks: list[tuple[int, int]] = []
        """The whitespace dropped after each call, [start, end) in the input: a token of it alone is dropped
        too (a talker fed a newline token after a call would speak it), one that also has text is not."""

    @property
    def num_decided_chars(self) -> int:
        """Leading input characters known to be text or part of a call (the text of an open call is)."""
        return self.num_fed_chars - (0 if self._is_in_call else len(self._pending))

    def feed(self, text: str) -> ToolStep:
        """The text of one delta that became plain, and the calls it closed."""
        buf = self._pending + text
        base = self.num_fed_chars - len(self._pending)  # input position of buf[0], for the call spans
        self.num_fed_chars += len(text)
        plain: list[str] = []
        calls: list[str] = []
        i = 0
        while True:
            if self._is_in_call:
                j = buf.find(CLOSE_TAG, i)
                if j < 0:
                    self._pending = buf[i:]
                    break
                calls.append(buf[i:j].strip())
                i = j + len(CLOSE_TAG)
                self.spans[-1] = CallSpan(self.spans[-1].start, base + i)
                self._is_in_call, self._is_after_call = False, True
                continue
            if self._is_after_call:
                start, i = i, len(buf) - len(buf[i:].lstrip())
                if i > start:
                    self._add_blank(base + start, base + i)
                if i == len(buf):
                    self._pending = ""
                    break
                self._is_after_call = False
            j = buf.find(OPEN_TAG, i)
            if j >= 0:
                plain.append(buf[i:j])
                self.spans.append(CallSpan(base + j, None))
                i = j + len(OPEN_TAG)
                self._is_in_call = True
                continue
            end = len(buf) - _num_tag_prefix_chars(buf, i)
            plain.append(buf[i:end])
            self._pending = buf[end:]
            break
        return ToolStep("".join(plain), tuple(calls))

    def finish(self) -> ToolStep:
        """The end of the text: a held prefix of a tag is text, an open call is reported unclosed."""
        pending, self._pending = self._pending, ""
        if not self._is_in_call:
            return ToolStep(pending)
        self._is_in_call = False
        # NOTE: reported with its opening tag: a raw call that starts with it was never closed (`UNCLOSED`),
        # which the session refuses even when its JSON happens to be whole.
        return ToolStep("", (OPEN_TAG + pending.strip(),))

    def is_call(self, start: int, end: int) -> bool:
        """Whether input [start, end) has a character of a call (an empty range: lies strictly inside one), or
        is only whitespace dropped after one."""
        return any(span.overlaps(start, end) for span in self.spans) or (
            start < end and any(a <= start and end <= b for a, b in self.blanks))

    def _add_blank(self, start: int, end: int) -> None:
        if self.blanks and self.blanks[-1][1] == start:
            start = self.blanks.pop()[0]  # NOTE: the same run of whitespace, arriving over several deltas
        self.blanks.append((start, end))


def _num_tag_prefix_chars(text: str, start: int) -> int:
    """Length of the longest suffix of `text[start:]` that is a proper prefix of `OPEN_TAG`."""
    for size in range(min(len(text) - start, len(OPEN_TAG) - 1), 0, -1):
        if OPEN_TAG.startswith(text[-size:]):
            return size
    return 0


def is_in_call(text: str, pos: int) -> bool:
    """Whether position `pos` of `text` is inside a call (opened before it, not closed before it), as
    `ToolCallFilter` reads the same text: the guardrails of `ar_stop.py` skip what is never spoken."""
    opened = text.rfind(OPEN_TAG, 0, pos)
    return opened >= 0 and text.find(CLOSE_TAG, opened, pos) < 0


@dataclass(frozen=True)
class _HeldToken:
    payload: dict[str, Any]
    """Its STREAM payload (its own "text" is ignored: a released emit carries the text released so far)."""
    start: int
    end: int
    """The token's text in the filter's input, [start, end)."""


class ToolCallGate:
    """One request's STREAM emits through a `ToolCallFilter` (see the module docstring)."""

    def __init__(self) -> None:
        self._filter = ToolCallFilter()
        self._held: deque[_HeldToken] = deque()
        self._num_token_chars = 0
        """Characters of output text the tokens so far have (the `StopChecker`'s text, before a stop cuts it)."""
        self._text: list[str] = []
        self._calls: list[str] = []
        self._unsent_text: list[str] = []
        self._unsent_calls: list[str] = []
        self._carried: dict[str, Any] = {}
        """Data of dropped tokens, for the next released one."""

    def step(self, payload: dict[str, Any], token_text: str, is_final: bool) -> list[dict[str, Any]]:
        """The STREAM payloads one sampled token releases, in order (maybe none). `payload["text"]` is the
        text the `StopChecker` released with it; `token_text` the token's own text; `is_final`: it ends
        the request."""
        released = self._filter.feed(payload["text"])
        self._take(released)
        if is_final:
            self._take(self._filter.finish())
        self._held.append(_HeldToken(payload, self._num_token_chars, self._num_token_chars + len(token_text)))
        self._num_token_chars += len(token_text)
        out: list[dict[str, Any]] = []
        while self._held and (is_final or self._held[0].end <= self._filter.num_decided_chars):
            token = self._held.popleft()
            is_last = is_final and not self._held
            if not is_last and self._filter.is_call(token.start, token.end):
                self._carry(token.payload)
            else:
                out.append(self._release(token.payload))
        if out:
            out[-1]["text"] = "".join(self._unsent_text)
            if self._unsent_calls:
                out[-1]["tool_calls"] = list(self._unsent_calls)
            self._unsent_text, self._unsent_calls = [], []
        return out

    def result(self) -> dict[str, Any]:
        """RESULT's fields: the plain text and every raw call."""
        return {"text": "".join(self._text), "tool_calls": list(self._calls)}

    def _take(self, step: ToolStep) -> None:
        if step.text:
            self._text.append(step.text)
            self._unsent_text.append(step.text)
        self._calls.extend(step.calls)
        self._unsent_calls.extend(step.calls)

    def _carry(self, payload: dict[str, Any]) -> None:
        for key, value in payload.items():
            if key in _PER_TOKEN_KEYS:
                continue
            before = self._carried.get(key)
            self._carried[key] = {**before, **value} if isinstance(before, dict) and isinstance(value, dict) else value

    def _release(self, payload: dict[str, Any]) -> dict[str, Any]:
        out = dict(payload)
        out["text"] = ""
        for key, value in self._carried.items():
            mine = out.get(key)
            if isinstance(value, dict) and isinstance(mine, dict):
                out[key] = {**value, **mine}
            elif key not in out:
                out[key] = value
        self._carried = {}
        return out
