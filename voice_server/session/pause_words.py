"""What a pause's words say about whether the speaker is done, beside Smart Turn's score of its sound: the
recogniser's hypotheses (`hypotheses_suggest_more`) and the thinker's reading of them (`text_suggests_more`),
weighed together by `read_pause_words` for `EndOfTurn.on_score` (`end_of_turn.py`). Pure functions of text.
"""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["MIN_TEXT_COMPLETE", "alternatives_suggest_more", "hypotheses_suggest_more", "read_pause_words",
           "text_suggests_more", "words_suggest_more"]

_CONTINUING_WORDS = frozenset([
    "a", "an", "the", "my", "your", "our", "their",  # determiners
    "of", "from", "into", "onto", "between", "during", "than",  # prepositions that never close a sentence
    "and", "or", "but", "nor", "because", "if", "although", "though", "unless", "whether",  # conjunctions
    "i", "um", "uh", "er", "erm",  # a subject, fillers
])
"""English words a sentence does not end on. A person who stops after one is not done ("I'd like a ...").
Only the safe ones: "for", "to", "with", "it", "that" and the auxiliaries end questions ("what is it
for?", "yes I can"), so they are left to the model."""


def words_suggest_more(transcript: str) -> bool:
    """Whether the turn's words so far stop where a sentence cannot end (Smart Turn hears prosody only:
    a synthetic or flat voice cut mid-sentence can sound finished to it)."""
    words = transcript.lower().replace("'", " ").split()
    return bool(words) and words[-1].strip(".,!?;:\"") in _CONTINUING_WORDS


MIN_WORDS_FOR_LONGER = 3
"""An alternative with more words than the final counts only where the final has at least this many: the
alternatives of a short answer add a word to it ("yeah and", "okay a"), while a hesitation's final often
lacks its dangling word ("the name" for "the name of")."""


def hypotheses_suggest_more(final: str, partial: str = "", alternatives: Sequence[str] = ()) -> bool:
    """`words_suggest_more` over every hypothesis of the turn so far: the recogniser's final, its last
    partial, and the alternatives it gives where it is unsure of the final's last word.

    A recogniser that scores the final as a whole sentence (PocketSphinx's language model ends it) turns a
    dangling "a" or "the" into "it" or "that"; its partial is not so scored and keeps them more often.
    Offline, on the turn-taking set's hesitations cut at their pause (3 seeds, 60 cuts), the final or the
    partial ended where a sentence cannot for 33, with the alternatives for 49; of 72 complete questions
    4 were flagged (2 by the final or partial alone), of 30 backchannels 4."""
    return words_suggest_more(final) or words_suggest_more(partial) or alternatives_suggest_more(final, alternatives)


def alternatives_suggest_more(final: str, alternatives: Sequence[str]) -> bool:
    """Whether an alternative to `final` ends where a sentence cannot (`MIN_WORDS_FOR_LONGER`)."""
    num_final = len(final.split())
    longer_ok = num_final >= MIN_WORDS_FOR_LONGER
    return any(words_suggest_more(a) for a in alternatives if longer_ok or len(a.split()) <= num_final)


MIN_TEXT_COMPLETE = 0.002
"""Under this probability that the user's message ends where its words do (the thinker's `turn_end_p`), the
words suggest more. The default thinker as served (SmolLM2-135M, w4a8, its system prompt) on the turn-taking
set's text as a recogniser writes it (lowercase, no punctuation; `loadtest/bench_turn_text.py`): its 12 whole
questions scored 0.0055-0.91 ("who wrote romeo and juliet" the lowest), its 10 hesitations cut at their pause
at most 0.00015 but "my flight is on" 0.0082, the words before those cuts under 0.002 at 35 of 40 lengths ("i
need to buy some" under 1e-4), the whole hesitation sentences 0.16-0.80. Misheard questions score as low ("how
many links to the spider have" 0.0002, "how far away is the man" 0.0021), hence only where the audio's score is
short of sure (`EndOfTurn`); a wrong hold costs `unfinished_silence_ms`."""


def text_suggests_more(turn_end_p: float | None) -> bool:
    """Whether the thinker, reading the turn's final transcript, expects the user to go on (None: no score)."""
    return turn_end_p is not None and turn_end_p < MIN_TEXT_COMPLETE


def read_pause_words(final: str, partial: str, alternatives: Sequence[str], turn_end_p: float | None,
                     is_narrowband: bool) -> tuple[bool, bool]:
    """What a pause's words say beside its score: (`is_unfinished`, `is_maybe_unfinished`) for `EndOfTurn.on_score`.

    Unfinished, whatever the score: the recogniser's final or last partial, or one of its alternatives, ends
    where a sentence cannot. Maybe unfinished, which a sure score outweighs: the thinker's reading, and on
    narrowband audio (a phone line's 8 kHz) the alternatives that rewrite the final's last words rather than
    add to them. Without the upper band the n-best spreads over words the recogniser cannot tell apart, and
    ends on "and" or "a" for finished questions ("capital of france" / "capital of free and", "what color it
    guy" / "what color it and"), while one that only adds a word ("the name" / "the name of") is the
    recogniser unsure whether a short word was said, as at a hesitation. Logged over 9 runs of the
    turn-taking set on `/twilio/media` (sure scores, nothing else flagging them): rewriting alternatives held
    10 of 108 finished questions ~1 s and caught 2 of 90 hesitation pauses ("find a" / "find him")."""
    adding = [a for a in alternatives if final and a.startswith(final + " ")] if is_narrowband else alternatives
    rewriting = [a for a in alternatives if a not in adding]
    is_unfinished = hypotheses_suggest_more(final, partial, adding)
    is_maybe_unfinished = text_suggests_more(turn_end_p) or alternatives_suggest_more(final, rewriting)
    return is_unfinished, is_maybe_unfinished
