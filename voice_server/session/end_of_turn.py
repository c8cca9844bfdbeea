"""`EndOfTurn`: the state machine of `semantic_vad`, on per-window speech probabilities and end-of-turn
scores. No model and no audio in here (`SemanticTurnDetector` feeds it), so tests script both.

Phases and their moves, one 32 ms window at a time (Silero VAD's window at 16 kHz):

    IDLE --(num_start_windows speech windows in a row)--> SPEAKING           emits SpeechStarted
    IDLE --(a first speech window / its run broken before that)--> IDLE     emits OnsetHeard / OnsetLost
    SPEAKING --(num_pause_windows non-speech in a row)--> PAUSED             emits SilenceStarted(token)
    PAUSED --(num_resume_windows speech in a row)--> SPEAKING                emits SpeechResumed
    PAUSED --(score >= min_complete and silence >= min_silence_ms)--> IDLE   emits SpeechStopped
    PAUSED --(score >= sure_complete and silence >= sure_silence_ms)--> IDLE emits SpeechStopped
    PAUSED --(silence >= max_silence_ms)--> IDLE                             emits SpeechStopped

where the words end where a sentence cannot (`is_unfinished`: `hypotheses_suggest_more` on the recogniser's
hypotheses), a score of `min_complete` or more commits only after `unfinished_silence_ms` of silence, and a
lower one after `max_silence_ms` as before. So where weaker evidence says the words may go on
(`is_maybe_unfinished`, `read_pause_words`: the thinker's reading, `text_suggests_more`, and some of a phone
line's alternatives) and the score is under `sure_complete`: the thinker reads what the recogniser heard, and a
misheard finished question reads as unfinished as a cut one ("how many links to the spider have": 0.0002,
Smart Turn 0.985), so a model sure the sentence sounds finished outweighs it, while one that is not (0.70 for
a pause after "i need to buy some") is settled by it.

`OnsetHeard` comes a window or more before a turn could open (`num_start_windows` > 1): a reply playing
may hold its audio at once, and go on at `OnsetLost` (a click, a blip) if the turn never opens.

`SilenceStarted` asks the caller to score the turn's audio so far (Smart Turn) and to hand the result
back with `on_score(token, probability, is_unfinished)` (`hypotheses_suggest_more` where the caller has
the turn's words); a score for an older pause (the speaker resumed since) is ignored. The commit waits
for whichever comes last of the score and `min_silence_ms`, and never waits past `max_silence_ms` (a slow
or failed score only costs that wait). Times are ms of the input timeline: window `i` is `[32 i, 32 i + 32)`.

Hysteresis: a window is speech at probability >= 0.5 and non-speech below 0.35 (Silero's own
convention); in between it continues the run it is in, so a flickering probability neither opens nor
closes anything by itself.

Quiet windows (`is_quiet`: near the line's noise floor, well under the speaker's level; `QuietGate` in
`semantic_vad.py`) count as non-speech once a turn is open, whatever Silero says: Silero's probability
stays high for 60-200 ms after the last word (measured on TTS speech), which would otherwise delay every
pause, and so the speculative response and the commit, by as much. A turn still opens on Silero alone
(a soft talker is not gated out).
"""

from __future__ import annotations

import enum
import math
from collections.abc import Sequence
from dataclasses import dataclass

from voice_server.session.turn_config import TurnDetectionConfig
from voice_server.session.vad import SpeechStarted, SpeechStopped

__all__ = ["WINDOW_MS", "EndOfTurn", "OnsetHeard", "OnsetLost", "Phase", "SilenceStarted", "SpeechResumed",
           "alternatives_suggest_more", "hypotheses_suggest_more", "read_pause_words", "text_suggests_more",
           "words_suggest_more"]

WINDOW_MS = 32
SPEECH_THRESHOLD = 0.5
HYSTERESIS = 0.15
PAUSE_MS = 96
"""Non-speech that makes a pause (three windows): shorter gaps are the stops inside words."""
RESUME_MS = 64
"""Speech that ends a pause: one window may be a click or a breath."""


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


@dataclass(frozen=True)
class SilenceStarted:
    """Speech paused (the turn stays open): score the turn so far and pass `token` back to `on_score`."""

    speech_end_ms: int
    token: int


@dataclass(frozen=True)
class OnsetHeard:
    """A speech window with no turn open: a turn may start (`SpeechStarted` once the run is long enough)."""

    audio_ms: int


@dataclass(frozen=True)
class OnsetLost:
    """The run of speech windows since `OnsetHeard` broke before it opened a turn."""

    audio_ms: int


@dataclass(frozen=True)
class SpeechResumed:
    """The speaker went on after a pause: whatever was started for that pause is moot."""

    audio_ms: int


class Phase(enum.Enum):
    IDLE = "idle"
    SPEAKING = "speaking"
    PAUSED = "paused"


class EndOfTurn:
    def __init__(self, config: TurnDetectionConfig) -> None:
        self.config = config
        self.rules = config.rules
        self.num_start_windows = max(1, math.ceil(config.start_speech_ms / WINDOW_MS))
        self.num_pause_windows = PAUSE_MS // WINDOW_MS
        self.num_resume_windows = RESUME_MS // WINDOW_MS
        self.phase = Phase.IDLE
        self.num_windows = 0
        """Windows stepped: the timeline position is `WINDOW_MS` times this."""
        self.turn_start_ms: int | None = None
        self.speech_end_ms = 0
        self.token = 0
        """The current pause's token; bumped by every pause and every end of one."""
        self.score: float | None = None
        """The current pause's end-of-turn probability, once scored."""
        self.is_unfinished = False
        """Whether the current pause's words end where a sentence cannot (given with its score)..."""
        self.is_maybe_unfinished = False
        """...and whether weaker evidence says they may go on (`read_pause_words`; a sure score outweighs it)."""
        self.num_speech_windows = 0
        """Speech windows since the open turn started (its onset's included)."""
        self._num_run = 0
        """Windows in a row of the kind that would move the phase on (speech in IDLE/PAUSED, else silence)."""
        self._run_start = 0
        self._floor_ms = 0

    @property
    def now_ms(self) -> int:
        return self.num_windows * WINDOW_MS

    def reset(self) -> None:
        """Forget the open turn (`input_audio_buffer.clear`); a later turn never starts before here."""
        self.phase, self.turn_start_ms, self.score, self._num_run = Phase.IDLE, None, None, 0
        self.token += 1
        self._floor_ms = self.now_ms

    def step(self, probability: float, is_quiet: bool = False) -> list[object]:
        """One window's speech probability (and whether it is quiet); the events it completes."""
        index = self.num_windows
        self.num_windows += 1
        is_opening = self.phase is Phase.IDLE
        is_speech = probability >= SPEECH_THRESHOLD and (is_opening or not is_quiet)
        is_silence = probability < SPEECH_THRESHOLD - HYSTERESIS or (is_quiet and not is_opening)
        if is_speech and not is_opening:
            self.num_speech_windows += 1
        if self.phase is Phase.SPEAKING:
            if is_silence:
                self._num_run += 1
            elif is_speech:
                self._num_run, self.speech_end_ms = 0, self.now_ms
            if self._num_run < self.num_pause_windows:
                return []
            self.phase, self._num_run, self.score, self.is_unfinished = Phase.PAUSED, 0, None, False
            self.is_maybe_unfinished = False
            self.token += 1
            return [SilenceStarted(self.speech_end_ms, self.token)]
        num_run_before = self._num_run
        if is_speech:
            if self._num_run == 0:
                self._run_start = index
            self._num_run += 1
        elif is_silence:
            self._num_run = 0
        if self.phase is Phase.IDLE:
            if self._num_run < self.num_start_windows:
                if self._num_run and not num_run_before:
                    return [OnsetHeard(index * WINDOW_MS)]
                return [OnsetLost(self.now_ms)] if num_run_before and not self._num_run else []
            onset_ms = self._run_start * WINDOW_MS
            self.turn_start_ms = max(self._floor_ms, onset_ms - self.config.prefix_padding_ms)
            self.phase, self._num_run, self.speech_end_ms = Phase.SPEAKING, 0, self.now_ms
            self.num_speech_windows = self.num_start_windows
            return [SpeechStarted(self.turn_start_ms)]
        if self._num_run >= self.num_resume_windows:
            self.phase, self._num_run, self.speech_end_ms, self.score = Phase.SPEAKING, 0, self.now_ms, None
            self.token += 1
            return [SpeechResumed(self.now_ms)]
        return self._decide()

    def on_score(self, token: int, probability: float, is_unfinished: bool = False,
                 is_maybe_unfinished: bool = False) -> list[object]:
        """The end-of-turn probability asked for by the `SilenceStarted` carrying `token`, whether the turn's
        words so far end where a sentence cannot, and whether weaker evidence says they may (`read_pause_words`)."""
        if token != self.token or self.phase is not Phase.PAUSED:
            return []
        self.score, self.is_unfinished, self.is_maybe_unfinished = probability, is_unfinished, is_maybe_unfinished
        return self._decide()

    def _decide(self) -> list[object]:
        silence_ms = self.now_ms - self.speech_end_ms
        rules = self.rules
        score = -1.0 if self.score is None else self.score
        if self.is_unfinished or (self.is_maybe_unfinished and score < rules.sure_complete):
            # NOTE: the model hears a finished sentence and the words say otherwise. Either may be wrong: a
            # flat voice cut after "a" sounds done, and a call's recogniser hears "France" as "free and".
            # A listener waits a beat longer, not the whole maximum silence, for the speaker to go on.
            is_done = score >= rules.min_complete and silence_ms >= rules.unfinished_silence_ms
        else:
            is_done = (score >= rules.sure_complete and silence_ms >= rules.sure_silence_ms) or (
                score >= rules.min_complete and silence_ms >= rules.min_silence_ms)
        if self._num_run:
            # NOTE: a speech window in the pause: the next one says whether the speaker went on (a resumption
            # takes two), and a commit now would be heard over them.
            is_done = False
        if is_done or silence_ms >= rules.max_silence_ms:
            event = SpeechStopped(self.now_ms, self.speech_end_ms)
            self.phase, self.turn_start_ms, self.score, self._num_run = Phase.IDLE, None, None, 0
            self.token += 1
            self._floor_ms = self.now_ms
            return [event]
        return []
