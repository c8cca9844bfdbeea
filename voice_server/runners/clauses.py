"""Streaming clause splitting for text-to-speech: cut an LLM's text deltas into speakable clauses.

A clause ends at a sentence end (`. ! ? …`) or a clause mark (`, ; :`), closing quotes, brackets or
markdown emphasis allowed after it, followed by whitespace; at a spaced dash (`a — b`, `a - b`,
`a -- b`), an unspaced em dash (`so—then`), before a spaced opening bracket (`it is 7 (I think)`: an
aside is said apart) or at a newline (a heading or list item, however short).
Not a clause end:
- a mark inside a number or a URL (`3.5`, `1,000`, `7:30`): no whitespace follows it;
- a period after a common abbreviation (`Dr.`, `e.g.`, `a.m.`), an initial (`J. K. Rowling`) or a
  list item's number (`2. Then`, at the start of a line);
- a clause shorter than `min_clause_chars` (speakable characters): it merges with the next, so
  the engine never gets fragments like "Yes," on their own.
With no mark in sight a clause is cut at the first whitespace past `max_clause_chars`, so audio
never waits on a run-on sentence; the first clause of a reply at the first whitespace past
`max_first_clause_chars`, shorter, since the listener waits for it (a reply that opens with a long
sentence starts speaking after ~8 words instead of after all of them). The first clause is also cut
at a phrase boundary once it has `min_first_phrase_chars`: before a verb, conjunction or preposition
that opens a phrase ("The capital of France | is Paris.", `PHRASE_STARTS`), where a speaker may
pause; each token of a clause is ~10 ms of the thinker on a small CPU before its audio can start.

NOTE: every decision is made at the character after the mark and depends only on the clause text
up to it, so feeding deltas one by one yields exactly the clauses the whole text does. A clause is
therefore complete one character after its mark (`3.` may still become `3.5`): with LLM tokens
that is the next token, whose leading space decides it.

`speakable` turns a clause into what the engine should read: URLs, markdown marks, emoji and other
symbols are dropped; a clause with nothing left to say becomes "".
"""

from __future__ import annotations

import re
import unicodedata
from dataclasses import dataclass

_ENDS = frozenset(".!?…,;:")
_CLOSERS = "\"'”’)]}*_`"
"""Allowed between a mark and the whitespace that confirms it (`"Hi!" she said`, `**Note:** x`)."""
_SPACED_DASHES = frozenset("—–")
_UNSPACED_DASH = "—"
"""Only the em dash cuts without spaces: an en dash joins ranges (`10–20`), a hyphen joins words."""
_ABBREVIATIONS = frozenset({
    "mr", "mrs", "ms", "mx", "dr", "prof", "sr", "jr", "st", "mt", "ft", "vs", "approx", "inc", "ltd", "corp",
    "dept", "gov", "lt", "sgt", "capt", "rev", "jan", "feb", "apr", "jul", "aug", "sept", "oct", "nov", "dec",
    "mon", "tue", "thu", "fri", "vol", "ch", "avg", "cf", "nos", "pp",
})
"""Lowercase words a period does not end a clause after (none that is also a common word: "sun.",
"no.", "min." end sentences more often than they abbreviate); dotted forms (`e.g`, `a.m`, `u.s`,
`ph.d`: parts of one or two letters) and single letters (initials) are recognised by shape."""

PHRASE_STARTS = frozenset({
    "is", "are", "was", "were", "has", "have", "had", "can", "could", "will", "would", "should", "may", "might",
    "must", "does", "did", "and", "but", "because", "which", "who", "so", "when", "where", "while", "if",
    "in", "on", "at", "for", "with", "from", "about", "during", "after", "before",
})
"""Words before which a reply's first clause may be cut: a verb after its subject, a conjunction, a
preposition that opens a phrase. Not "of" or "to", which bind to the word before ("point of", "want to")."""
_MARKS = re.compile(r"[.!?…,;:—–]\s")
"""A mark that a word follows: where a phrase starts."""
_LIST_NUMBER = re.compile(r"(?:^|\n)\s*\d{1,3}$")
"""`1.` opening a line numbers a list item; it does not end one."""
_URL = re.compile(r"(?:https?://|ftp://|www\.)\S*?(?=[.,;:!?)\]\"']*(?:\s|$))", re.IGNORECASE)
_MARKDOWN_LINK = re.compile(r"\[([^\]]*)\]\([^)]*\)")
_LINE_MARKUP = re.compile(r"^\s*(?:(?:#{1,6}|>|[-+•])\s+)+")
"""Headings, quotes and list bullets at the start of a clause (nested ones too: "> - item"): read the
text, not the marks."""
_INLINE_MARKUP = re.compile(r"[*_`~\\\[\]{}|]+")
_SPACE_BEFORE_MARK = re.compile(r"\s+([,.;:!?…])")
_KEPT_SYMBOLS = frozenset("°")
_DROPPED_CATEGORIES = frozenset({"So", "Sk", "Cs", "Co", "Cn", "Cf", "Cc", "Me"})
_VARIATION_SELECTORS = frozenset("\ufe0e\ufe0f")


@dataclass(frozen=True)
class ClauseRules:
    min_clause_chars: int = 10
    """Clauses with fewer speakable characters merge with the next one."""
    max_clause_chars: int = 240
    """A clause with no mark is cut at the first whitespace after this many characters."""
    max_first_clause_chars: int = 48
    """The same for the reply's first clause."""
    min_first_phrase_chars: int = 12
    """The reply's first clause is cut before a word of `PHRASE_STARTS` once it has this many speakable
    characters (0: never)."""

    def __post_init__(self) -> None:
        for name, minimum in (("min_clause_chars", 1), ("max_clause_chars", 1), ("max_first_clause_chars", 1),
                              ("min_first_phrase_chars", 0)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
                raise ValueError(f"ClauseRules.{name} must be an integer >= {minimum}, got {value!r}")
        for name in ("max_clause_chars", "max_first_clause_chars"):
            if getattr(self, name) <= self.min_clause_chars:
                raise ValueError(f"ClauseRules.{name} ({getattr(self, name)}) must be greater than "
                                 f"min_clause_chars ({self.min_clause_chars})")


class ClauseSplitter:
    """Feed text deltas in order; get each clause (already `speakable`) as soon as it is complete."""

    def __init__(self, rules: ClauseRules | None = None) -> None:
        self.rules = rules or ClauseRules()
        self._pending = ""
        """Text after the last cut, not yet given out."""
        self._num_scanned = 0
        """Characters of `_pending` whose cut decision is made."""
        self.num_clauses = 0
        """Clauses given out so far (the first is cut shorter)."""

    @property
    def num_pending_chars(self) -> int:
        return len(self._pending)

    def feed(self, delta: str) -> list[str]:
        """The clauses `delta` completes (none while a clause is still open)."""
        self._pending += delta
        clauses: list[str] = []
        i = self._num_scanned
        while i < len(self._pending):
            cut = self._cut_before(i)
            if cut is None:
                i += 1
                continue
            end, start = cut
            clause, self._pending = self._pending[:end], self._pending[start:]
            i = 0
            spoken = speakable(clause)
            if spoken:
                clauses.append(spoken)
                self.num_clauses += 1
        self._num_scanned = len(self._pending)
        return clauses

    def flush(self) -> list[str]:
        """The text still open (end of stream), as at most one clause; the splitter is empty after."""
        rest, self._pending, self._num_scanned = self._pending, "", 0
        spoken = speakable(rest)
        return [spoken] if spoken else []

    def _cut_before(self, i: int) -> tuple[int, int] | None:
        """Whether a clause ends as `_pending[i]` arrives; if so, (where it ends, where the next starts)."""
        text, char = self._pending, self._pending[i]
        if not char.isspace():
            if char == "(" and i > 0 and text[i - 1].isspace():
                return (i - 1, i) if self._is_long_enough(text[:i - 1]) else None
            is_dash_cut = i > 0 and text[i - 1] == _UNSPACED_DASH and char not in _SPACED_DASHES
            return (i, i) if is_dash_cut and self._is_long_enough(text[:i]) else None
        before = text[:i]
        if char == "\n":
            # NOTE: a line break ends a heading or list item, however short.
            return (i, i + 1) if speakable(before) else None
        if _ends_clause(before):
            return (i, i + 1) if self._is_long_enough(before) else None
        rules = self.rules
        if self.num_clauses == 0:
            phrase_end = self._phrase_end(before)
            if phrase_end is not None:
                return phrase_end, phrase_end + 1
        max_chars = min(rules.max_first_clause_chars, rules.max_clause_chars) if self.num_clauses == 0 else (
            rules.max_clause_chars)
        return (i, i + 1) if len(before) >= max_chars else None

    def _phrase_end(self, before: str) -> int | None:
        """Where the first clause ends if the word `before` ends with opens a phrase (`PHRASE_STARTS`) and
        the words ahead of it are long enough: the whitespace before that word."""
        minimum = self.rules.min_first_phrase_chars
        if not minimum:
            return None
        start = max(before.rfind(" "), before.rfind("\t"))
        if start <= 0 or before[start + 1:].lower() not in PHRASE_STARTS:
            return None
        ahead = before[:start]
        # NOTE: counted from the last mark ("Sure! The sky | is ..." would cut a three-word phrase); a mark
        # right before the word had its own chance to cut.
        phrase = _MARKS.split(ahead)[-1]
        if _ends_clause(ahead) or len(speakable(phrase)) < minimum:
            return None
        return start

    def _is_long_enough(self, clause: str) -> bool:
        return len(speakable(clause)) >= self.rules.min_clause_chars


def _ends_clause(text: str) -> bool:
    """Whether `text`, followed by whitespace, ends a clause (the mark rules of the module note)."""
    core = text.rstrip(_CLOSERS)
    if not core:
        return False
    last = core[-1]
    if last == ".":
        return not (_is_abbreviation(core[:-1]) or _LIST_NUMBER.search(core[:-1]))
    if last in _ENDS or last in _SPACED_DASHES:
        return True
    if last == "-":
        return core.endswith("--") or len(core) == 1 or core[-2].isspace()
    return False


def _is_abbreviation(text: str) -> bool:
    """Whether the word that ends `text` (before its period) is an abbreviation or an initial."""
    word = re.split(r"[\s—–(\[\"'“‘*_]", text)[-1].lower()
    if len(word) == 1:
        return word.isalpha()
    if "." in word:
        parts = word.split(".")
        return all(1 <= len(p) <= 2 and p.isalpha() for p in parts)
    return word in _ABBREVIATIONS


def speakable(text: str) -> str:
    """`text` as the engine should read it: no URLs, markdown marks, emoji or other symbols; "" when
    nothing speakable (a letter or digit) is left."""
    text = _MARKDOWN_LINK.sub(r"\1", text)
    text = _URL.sub(" ", text)
    # NOTE: inline marks first: "-**bold**" is a bullet only once its stars are gone ("- bold").
    text = _INLINE_MARKUP.sub(" ", text)
    text = _LINE_MARKUP.sub("", text)
    text = "".join(c for c in text if _is_kept(c))
    text = _SPACE_BEFORE_MARK.sub(r"\1", " ".join(text.split()))
    return text if any(c.isalnum() for c in text) else ""


def _is_kept(char: str) -> bool:
    if char in _KEPT_SYMBOLS or char.isspace():
        return True
    return char not in _VARIATION_SELECTORS and unicodedata.category(char) not in _DROPPED_CATEGORIES
