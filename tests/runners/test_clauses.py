"""The streaming clause splitter of the text-to-speech stage: where clauses end, what is spoken, and
that text fed in deltas (any split) gives exactly the clauses of the whole text."""

from __future__ import annotations

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from voice_server.runners.clauses import ClauseRules, ClauseSplitter, speakable


def whole(text: str, rules: ClauseRules | None = None) -> list[str]:
    splitter = ClauseSplitter(rules)
    return splitter.feed(text) + splitter.flush()


def by_char(text: str, rules: ClauseRules | None = None) -> list[str]:
    splitter = ClauseSplitter(rules)
    clauses = [c for char in text for c in splitter.feed(char)]
    return clauses + splitter.flush()


@pytest.mark.parametrize(("text", "want"), [
    ("Hello there, how are you today? I am fine!",
     ["Hello there,", "how are you today?", "I am fine!"]),
    ("It costs 3.5 dollars, or 1,000 yen at 7:30 tonight.",
     ["It costs 3.5 dollars,", "or 1,000 yen at 7:30 tonight."]),
    ("Dr. Smith met J. K. Rowling at 7 p.m. today; e.g. at the cafe. Then they left.",
     ["Dr. Smith met J. K. Rowling at 7 p.m. today;", "e.g. at the cafe.", "Then they left."]),
    ("First we cook — then we eat the whole meal - and then -- we rest",
     ["First we cook —", "then we eat the whole meal -", "and then --", "we rest"]),
    ("It was late—so we went home, pages 10–20 unread.",
     ["It was late—", "so we went home,", "pages 10–20 unread."]),
    ("He said \"I am done!\" and walked away quietly.",
     ['He said "I am done!"', "and walked away quietly."]),
    ("A line without a mark\nAnother line here", ["A line without a mark", "Another line here"]),
    ("Steps:\n1. Mix\n2. Bake it for 20 minutes.\n\nDone.",
     ["Steps:", "1. Mix", "2. Bake it for 20 minutes.", "Done."]),
    ("Wait... what happened here? Nothing.", ["Wait... what happened here?", "Nothing."]),
    ("The answer is 10:12:59 (I am an AI) and that is all.",
     ["The answer is 10:12:59", "(I am an AI) and that is all."]),
    # NOTE: no cut inside "f(x)" (no space before it), nor after "(or later": shorter than min_clause_chars.
    ("Call f(x) now (or later (maybe)), fine.", ["Call f(x) now", "(or later (maybe)),", "fine."]),
])
def test_clause_ends(text: str, want: list[str]) -> None:
    assert whole(text) == want
    assert by_char(text) == want


def test_short_fragments_merge_with_the_next_clause() -> None:
    assert whole("Yes, so. Sure, okay: here we go now.") == ["Yes, so. Sure,", "okay: here we go now."]
    assert whole("Yes.") == ["Yes."]  # NOTE: the end of input flushes whatever is left
    short = ClauseRules(min_clause_chars=1, max_clause_chars=240)
    assert whole("Yes, sure. Well, okay.", short) == ["Yes,", "sure.", "Well,", "okay."]


def test_a_clause_is_given_out_as_soon_as_the_next_character_decides_it() -> None:
    splitter = ClauseSplitter()
    assert splitter.feed("Hello there") == []
    assert splitter.feed(".") == []  # NOTE: "there.5" is still possible
    assert splitter.feed(" How") == ["Hello there."]
    assert splitter.feed(" are you? I am") == ["How are you?"]
    assert splitter.flush() == ["I am"]
    assert splitter.flush() == [] and splitter.num_pending_chars == 0


def test_a_run_on_clause_is_cut_at_whitespace_past_max_clause_chars() -> None:
    rules = ClauseRules(min_clause_chars=5, max_clause_chars=20)
    text = "one two three four five six seven eight nine ten"
    assert whole(text, rules) == ["one two three four five", "six seven eight nine", "ten"]
    assert by_char(text, rules) == whole(text, rules)


def test_the_first_clause_is_cut_sooner_so_a_long_opening_sentence_speaks_early() -> None:
    text = ("Once upon a time in a land far away there lived a dragon who loved to read old books. "
            "He read every day in a cave full of candles and maps and little wooden boxes of tea leaves.")
    rules = ClauseRules(min_first_phrase_chars=0)  # NOTE: the length cut alone (the phrase cut: below)
    clauses = whole(text, rules)
    assert clauses[0] == "Once upon a time in a land far away there lived a"  # NOTE: the first word past 48
    assert clauses[1] == "dragon who loved to read old books."
    assert len(clauses[2]) > 48  # NOTE: later clauses keep the long limit
    assert by_char(text, rules) == clauses
    assert whole("Yes, of course.", rules) == ["Yes, of course."]


@pytest.mark.parametrize(("text", "clauses"), [
    ("The capital of France is Paris.", ["The capital of France", "is Paris."]),
    ("The boiling point of water is 100 degrees. It boils.", ["The boiling point of water", "is 100 degrees.",
                                                               "It boils."]),
    ("Once upon a time in a land far away there lived a dragon.", ["Once upon a time",
                                                                   "in a land far away there lived a dragon."]),
    ("Sure! The sky is usually blue during the day.", ["Sure! The sky is usually blue", "during the day."]),
    ("Two plus two equals 4.", ["Two plus two equals 4."]),  # NOTE: no word that opens a phrase
    ("Monday is a Friday.", ["Monday is a Friday."]),  # NOTE: too short before "is"
    ("The island is big. The sky is blue and wide.", ["The island is big.", "The sky is blue and wide."]),
])
def test_the_first_clause_is_cut_where_a_phrase_starts(text: str, clauses: list[str]) -> None:
    """Before a verb, conjunction or preposition that opens a phrase, once 12 characters precede it since
    the last mark: the listener hears the reply's first words a clause's tokens sooner; only the first
    clause, and the same clauses however the text arrives."""
    assert whole(text, ClauseRules()) == clauses
    assert by_char(text, ClauseRules()) == clauses


@pytest.mark.parametrize(("text", "want"), [
    ("**Note:** read `the docs` _now_.", "Note: read the docs now."),
    ("Visit https://example.com/a.b?c=1, or www.example.org.", "Visit, or."),
    ("See [the guide](https://example.com/guide) today!", "See the guide today!"),
    ("Great job 😀👍🏽! ❤️ It is 25°C.", "Great job! It is 25°C."),
    ("## Heading words", "Heading words"),
    ("- a bullet item", "a bullet item"),
    ("😀 🎉", ""),
    ("https://example.com", ""),
    ("...", ""),
])
def test_speakable_drops_what_cannot_be_spoken(text: str, want: str) -> None:
    assert speakable(text) == want


def test_unspeakable_clauses_are_skipped() -> None:
    assert whole("Look at this: https://example.com/x.html\n😀😀\nThat is all for today.") == \
        ["Look at this:", "That is all for today."]
    assert whole("") == [] and whole("   ") == [] and whole("🎉") == []


def test_rules_are_validated() -> None:
    for bad in ({"min_clause_chars": 0}, {"max_clause_chars": True}, {"min_clause_chars": 20, "max_clause_chars": 20},
                {"max_first_clause_chars": 10}):
        with pytest.raises(ValueError, match="ClauseRules"):
            ClauseRules(**bad)  # type: ignore[arg-type]


_WORDS = ["Hello", "Dr.", "e.g.", "3.5", "1,000", "7:30", "J.", "well", "the", "a", "U.S.", "https://x.io/a.b",
          "**bold**", "😀", "café", "—", "-", "--", "–", "10–20", "...", "\n", "“quoted”", "(aside)"]
_MARKS = ["", "", "", ",", ".", "!", "?", ";", ":", "—", "!\"", ".)", "..."]


@st.composite
def texts_and_splits(draw: st.DrawFn) -> tuple[str, list[str]]:
    pieces = draw(st.lists(st.tuples(st.sampled_from(_WORDS), st.sampled_from(_MARKS),
                                     st.sampled_from([" ", " ", "", "  ", "\n"])), max_size=40))
    text = "".join(w + m + s for w, m, s in pieces)
    cuts = sorted(draw(st.sets(st.integers(0, len(text)), max_size=20)))
    bounds = [0, *cuts, len(text)]
    return text, [text[a:b] for a, b in zip(bounds, bounds[1:])]


@settings(max_examples=300, deadline=None)
@given(case=texts_and_splits(), min_chars=st.integers(1, 30))
@example(case=("-**bold** ", ["-**bold** "]), min_chars=1)  # NOTE: once read "- bold", not "bold"
@example(case=("- - Hello ", ["- - Hello "]), min_chars=1)  # NOTE: once read "- Hello" (one bullet cut)
def test_any_split_into_deltas_gives_the_clauses_of_the_whole_text(case: tuple[str, list[str]], min_chars: int) -> None:
    text, deltas = case
    rules = ClauseRules(min_clause_chars=min_chars, max_clause_chars=min_chars + 40)
    splitter = ClauseSplitter(rules)
    streamed = [c for delta in deltas for c in splitter.feed(delta)] + splitter.flush()
    assert streamed == whole(text, rules)
    assert all(c and c == speakable(c) for c in streamed)
