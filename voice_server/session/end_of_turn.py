"""`EndOfTurn`: the state machine of `semantic_vad`, on per-window speech probabilities and end-of-turn
scores. No model and no audio in here (`SemanticTurnDetector` feeds it), so tests script both.

Phases and their moves, one 32 ms window at a time (Silero VAD's window at 16 kHz):

    IDLE --(num_start_windows speech windows in a row)--> SPEAKING           emits SpeechStarted
    IDLE --(a first speech window / its run broken before that)--> IDLE     emits OnsetHeard / OnsetLost
    SPEAKING --(num_pause_windows non-speech in a row)--> PAUSED             emits SilenceStarted(token)
    PAUSED --(num_resume_windows speech in a row)--> SPEAKING                emits SpeechResumed
    PAUSED --(score >= min_complete and silence >= min_silence_ms)--> IDLE   emits SpeechStopped
    PAUSED --(score >= sure_complete and silence >= sure_silence_ms *)--> IDLE emits SpeechStopped
    PAUSED --(silence >= max_silence_ms)--> IDLE                             emits SpeechStopped

(* or `patience_ms`, where longer: what this speaker's pauses taught, `_learn_patience`), and
where the words end where a sentence cannot (`is_unfinished`: `pause_words.hypotheses_suggest_more` on the recogniser's
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
from dataclasses import dataclass

from voice_server.session.turn_config import TurnDetectionConfig
from voice_server.session.vad import SpeechStarted, SpeechStopped

__all__ = ["WINDOW_MS", "EndOfTurn", "OnsetHeard", "OnsetLost", "Phase", "SilenceStarted", "SpeechResumed"]

WINDOW_MS = 32
SPEECH_THRESHOLD = 0.5
HYSTERESIS = 0.15
PAUSE_MS = 96
"""Non-speech that makes a pause (three windows): shorter gaps are the stops inside words."""
RESUME_MS = 64
"""Speech that ends a pause: one window may be a click or a breath."""
HESITATION_MS = 320
"""A pause inside a turn at least this long, after which the speaker went on, is a hesitation that
`EndOfTurn.patience_ms` learns from: a voice's own gaps inside a sentence are up to ~260 ms."""
CUT_OFF_MS = 1000
"""A turn that opens within this long of the end of the turn before it, which the machine had ended: the
speaker was not done (a reply ~300 ms after the end is at most ~700 ms old, too soon to be answered), and
`EndOfTurn.patience_ms` learns the pause they took."""
PATIENCE_FACTOR = 1.5
"""After a hesitation of P ms a sure score commits only after `PATIENCE_FACTOR` * P of silence (up to
`min_silence_ms`): one person's hesitations vary, and waiting out exactly P catches about half."""
PATIENCE_DECAY = 0.75
"""What is left of the learned wait after a turn the speaker said without a hesitation."""


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
        self.patience_ms = 0
        """Silence a sure score now waits for, where that is longer than `sure_silence_ms`: learned from this
        speaker's hesitations (a pause of `HESITATION_MS` or more that they went on from, or one that a turn was
        ended in: `CUT_OFF_MS`), and let go over the turns they say without one."""
        self._ended_speech_ms: int | None = None
        """The end of speech of the turn this machine ended last, until the next turn opens."""
        self._patience_before: tuple[int, bool] | None = None
        """`patience_ms` and `_is_hesitant` before the open turn changed them: a dropped turn (`reset`) teaches
        nothing."""
        self._is_hesitant = False
        """Whether the open (or last) turn taught `patience_ms` a hesitation."""

    @property
    def now_ms(self) -> int:
        return self.num_windows * WINDOW_MS

    def reset(self) -> None:
        """Forget the open turn (`input_audio_buffer.clear`, speech over a reply dismissed as no turn); a later
        turn never starts before here."""
        if self.phase is not Phase.IDLE and self._patience_before is not None:
            self.patience_ms, self._is_hesitant = self._patience_before
        self.phase, self.turn_start_ms, self.score, self._num_run = Phase.IDLE, None, None, 0
        self.token += 1
        self._floor_ms = self.now_ms
        self._ended_speech_ms = self._patience_before = None

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
            self._learn_patience(onset_ms)
            self.turn_start_ms = max(self._floor_ms, onset_ms - self.config.prefix_padding_ms)
            self.phase, self._num_run, self.speech_end_ms = Phase.SPEAKING, 0, self.now_ms
            self.num_speech_windows = self.num_start_windows
            return [SpeechStarted(self.turn_start_ms)]
        if self._num_run >= self.num_resume_windows:
            if (pause_ms := self._run_start * WINDOW_MS - self.speech_end_ms) >= HESITATION_MS:
                self._learn_pause(pause_ms)
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
            sure_silence_ms = max(rules.sure_silence_ms, self.patience_ms)
            is_done = (score >= rules.sure_complete and silence_ms >= sure_silence_ms) or (
                score >= rules.min_complete and silence_ms >= rules.min_silence_ms)
        if self._num_run:
            # NOTE: a speech window in the pause: the next one says whether the speaker went on (a resumption
            # takes two), and a commit now would be heard over them.
            is_done = False
        if is_done or silence_ms >= rules.max_silence_ms:
            event = SpeechStopped(self.now_ms, self.speech_end_ms)
            self.phase, self.turn_start_ms, self.score, self._num_run = Phase.IDLE, None, None, 0
            self.token += 1
            self._floor_ms, self._ended_speech_ms = self.now_ms, self.speech_end_ms
            return [event]
        return []

    def _learn_patience(self, onset_ms: int) -> None:
        """A turn opens at `onset_ms`: if the one before ended less than `CUT_OFF_MS` before it, its speaker
        was cut off in a pause (the reply to the cut-off words is the session's barge-in to stop), and the
        pause is learned as a hesitation; otherwise the learned wait fades if that turn had no hesitation."""
        ended_ms, self._ended_speech_ms = self._ended_speech_ms, None
        self._patience_before = self.patience_ms, self._is_hesitant
        was_hesitant, self._is_hesitant = self._is_hesitant, False
        if ended_ms is None:
            return
        if onset_ms - ended_ms < CUT_OFF_MS:
            self._learn_pause(onset_ms - ended_ms)
        elif not was_hesitant:
            # NOTE: a turn said without a hesitation lets the wait fade; one with another keeps it whole
            self.patience_ms = int(self.patience_ms * PATIENCE_DECAY)

    def _learn_pause(self, pause_ms: int) -> None:
        """This speaker paused `pause_ms` and went on: sure scores wait longer from now on.

        Smart Turn hears a voice's sound, and a pause after "a" or "the" that sounds finished scores sure, while
        the recogniser may hear the word as "it" or "that": the words then miss it too. A listener who has heard
        a speaker stop mid-sentence, whether they waited it out or answered it, waits longer for that speaker.
        Only sure scores wait: a middling one already waits `min_silence_ms`, and the wait never goes past it."""
        learned_ms = int(PATIENCE_FACTOR * pause_ms)
        self.patience_ms = min(self.rules.min_silence_ms, max(self.patience_ms, learned_ms))
        self._is_hesitant = True
