"""The `semantic_vad` end-of-turn state machine with scripted speech probabilities and scores (no model):
a turn opens on enough speech, a pause asks for a score, a complete-sounding turn commits after the
eagerness's minimum silence, an unfinished one waits up to its maximum, a resumed speaker voids the
pause's score, and the config speaks OpenAI's `semantic_vad`."""

from __future__ import annotations

import pytest

from voice_server.session.end_of_turn import (
    CUT_OFF_MS,
    HESITATION_MS,
    PATIENCE_DECAY,
    PATIENCE_FACTOR,
    WINDOW_MS,
    EndOfTurn,
    OnsetHeard,
    OnsetLost,
    Phase,
    SilenceStarted,
    SpeechResumed,
)
from voice_server.session.pause_words import (
    hypotheses_suggest_more,
    read_pause_words,
    text_suggests_more,
    words_suggest_more,
)
from voice_server.session.turn_config import (
    DEFAULT_MIN_SPEECH_MS,
    EAGERNESS,
    SEMANTIC_MIN_SPEECH_MS,
    TurnDetectionConfig,
)
from voice_server.session.vad import SpeechStarted, SpeechStopped

SEMANTIC = TurnDetectionConfig(type="semantic_vad", prefix_padding_ms=96, min_speech_ms=120)
"""120 ms of speech opens a turn here (four windows; the default is two), so that a start is a run to script."""


def run(machine: EndOfTurn, probabilities: list[float], is_onsets: bool = False) -> list[tuple[int, object]]:
    """(window index, event) of every event the windows produce (`OnsetHeard`/`OnsetLost` with `is_onsets`)."""
    out = []
    for probability in probabilities:
        index = machine.num_windows
        out.extend((index, event) for event in machine.step(probability)
                   if is_onsets or not isinstance(event, OnsetHeard | OnsetLost))
    return out


def windows(ms: int) -> int:
    return -(-ms // WINDOW_MS)


def speak(machine: EndOfTurn, ms: int = 640) -> SilenceStarted:
    """Silence, then speech of `ms`, then silence until the pause is seen; returns its `SilenceStarted`."""
    events = run(machine, [0.0] * 5 + [0.9] * windows(ms) + [0.05] * 3)
    assert [type(e) for _, e in events] == [SpeechStarted, SilenceStarted]
    return events[1][1]  # type: ignore[return-value]


def test_a_turn_opens_after_min_speech_with_its_prefix_padding() -> None:
    machine = EndOfTurn(SEMANTIC)
    assert machine.num_start_windows == 4  # NOTE: 120 ms of speech -> four 32 ms windows
    events = run(machine, [0.0] * 10 + [0.9] * 3 + [0.0] + [0.9] * 4)
    (index, started), = events
    assert index == 17 and started == SpeechStarted(14 * WINDOW_MS - 96)
    assert machine.phase is Phase.SPEAKING


def test_semantic_vad_opens_a_turn_on_two_windows_unless_told_otherwise() -> None:
    assert EndOfTurn(TurnDetectionConfig(type="semantic_vad")).num_start_windows == 2
    assert TurnDetectionConfig(type="semantic_vad").min_speech_ms == SEMANTIC_MIN_SPEECH_MS == 64
    assert TurnDetectionConfig().min_speech_ms == DEFAULT_MIN_SPEECH_MS  # NOTE: server_vad keeps 120 ms
    assert TurnDetectionConfig.from_openai({"type": "semantic_vad"}) == TurnDetectionConfig(type="semantic_vad")


def test_a_short_blip_and_a_flickering_probability_open_nothing() -> None:
    machine = EndOfTurn(SEMANTIC)
    # NOTE: 0.4 is between the thresholds (0.35 / 0.5): it neither counts as speech nor breaks a run.
    assert run(machine, [0.9, 0.9, 0.9, 0.0, 0.4, 0.4, 0.9, 0.0, 0.9, 0.9, 0.4, 0.9, 0.0]) == []
    assert run(machine, [0.9, 0.4, 0.9, 0.9, 0.9]) != []  # NOTE: the in-between window kept the run


def test_an_onset_is_heard_at_its_first_window_and_lost_when_its_run_breaks_before_a_turn() -> None:
    machine = EndOfTurn(SEMANTIC)
    events = run(machine, [0.0] * 3 + [0.9, 0.4, 0.9, 0.0] + [0.9] * 4 + [0.9] * 3, is_onsets=True)
    # NOTE: the in-between window (0.4) keeps the run: one onset, lost at the silent window; the next run
    # is heard again and opens the turn at its fourth window; a turn open hears no onsets.
    assert [(i, type(e)) for i, e in events] == [(3, OnsetHeard), (6, OnsetLost), (7, OnsetHeard),
                                                 (10, SpeechStarted)]
    assert events[0][1] == OnsetHeard(3 * WINDOW_MS) and events[1][1] == OnsetLost(7 * WINDOW_MS)
    one_window = EndOfTurn(TurnDetectionConfig(type="semantic_vad", min_speech_ms=32))
    assert [type(e) for _, e in run(one_window, [0.0, 0.9], is_onsets=True)] == [SpeechStarted]


def test_a_complete_turn_commits_once_scored_and_silent_long_enough() -> None:
    machine = EndOfTurn(SEMANTIC)  # eagerness auto = medium
    rules = EAGERNESS["medium"]
    pause = speak(machine)
    speech_end = pause.speech_end_ms
    assert machine.now_ms - speech_end == 96 and machine.phase is Phase.PAUSED
    assert machine.on_score(pause.token, 0.8) == []  # NOTE: 96 ms of silence < min_silence_ms, 0.8 < sure
    events = run(machine, [0.0] * windows(rules.min_silence_ms))
    (index, stopped), = events
    # NOTE: at the first window that makes the silence at least min_silence_ms.
    assert stopped == SpeechStopped(speech_end + windows(rules.min_silence_ms) * WINDOW_MS, speech_end)
    assert machine.phase is Phase.IDLE and machine.turn_start_ms is None


def sure_commit_ms(machine: EndOfTurn, pause: SilenceStarted) -> int:
    """Silence at which a turn scored sure at `pause` commits (stepping silent windows)."""
    events = machine.on_score(pause.token, machine.rules.sure_complete)
    events += [e for _, e in run(machine, [0.0] * windows(machine.rules.max_silence_ms))]
    (stopped,) = events
    assert isinstance(stopped, SpeechStopped) and stopped.speech_end_ms == pause.speech_end_ms
    return stopped.audio_end_ms - pause.speech_end_ms


def test_a_sure_score_commits_after_a_short_silence() -> None:
    rules = EAGERNESS["medium"]
    unsure, sure = EndOfTurn(SEMANTIC), EndOfTurn(SEMANTIC)
    # NOTE: just under sure, the turn waits for min_silence_ms; at sure, for sure_silence_ms (six windows): a voice
    # leaves gaps up to ~260 ms inside a sentence, and the prepared reply is not ready much sooner.
    pause = speak(unsure)
    assert unsure.now_ms - pause.speech_end_ms < rules.min_silence_ms
    assert unsure.on_score(pause.token, rules.sure_complete - 0.01) == [] and unsure.phase is Phase.PAUSED
    pause = speak(sure)
    assert sure.on_score(pause.token, rules.sure_complete) == [] and sure.phase is Phase.PAUSED
    assert sure_commit_ms(sure, pause) == windows(rules.sure_silence_ms) * WINDOW_MS == 192
    # NOTE: `high` commits at the pause; `low` waits longer.
    for eagerness, commit_ms in [("high", 96), ("low", windows(EAGERNESS["low"].sure_silence_ms) * WINDOW_MS)]:
        machine = EndOfTurn(TurnDetectionConfig(type="semantic_vad", eagerness=eagerness))
        assert sure_commit_ms(machine, speak(machine)) == commit_ms


def test_a_speech_window_in_the_pause_defers_the_commit_to_the_next() -> None:
    """A window of speech when the silence would commit: the speaker may be going on (two windows resume the
    turn), so the commit waits for the next window; one that is silent again commits."""
    rules = EAGERNESS["medium"]
    machine = EndOfTurn(SEMANTIC)
    pause = speak(machine)
    assert machine.on_score(pause.token, 0.99) == []
    num_silent = windows(rules.sure_silence_ms) - 3 - 1  # NOTE: the pause's three windows are behind
    assert run(machine, [0.0] * num_silent + [0.9]) == []
    (index, stopped), = run(machine, [0.0])
    assert stopped == SpeechStopped(machine.now_ms, pause.speech_end_ms)
    resumed = EndOfTurn(SEMANTIC)
    pause = speak(resumed)
    assert resumed.on_score(pause.token, 0.99) == []
    assert [type(e) for _, e in run(resumed, [0.0] * num_silent + [0.9, 0.9])] == [SpeechResumed]


def answered_then_going_on(machine: EndOfTurn, pause_ms: int) -> int:
    """A turn scored sure at its pause and ended by the machine, then the speaker going on `pause_ms` after
    the end of its speech (a new turn opens); returns the pause as the machine measured it."""
    pause = speak(machine)
    events = machine.on_score(pause.token, 0.99)
    silent = [0.0] * (windows(pause_ms) - 3)  # NOTE: the pause's three windows are behind
    events += [e for _, e in run(machine, silent + [0.9] * machine.num_start_windows)]
    assert [type(e) for e in events] == [SpeechStopped, SpeechStarted]
    assert isinstance(events[0], SpeechStopped) and events[0].speech_end_ms == pause.speech_end_ms
    onset_ms = (machine.num_windows - machine.num_start_windows) * WINDOW_MS
    return onset_ms - pause.speech_end_ms


def test_a_speaker_answered_in_a_pause_who_goes_on_gets_a_longer_wait_for_sure_scores() -> None:
    """Answered 192 ms into a 608 ms hesitation, the speaker went on: from then on a sure score waits 1.5x
    that pause, since one person's pauses vary; a middling score's wait (1 s at medium) is the most."""
    rules = EAGERNESS["medium"]
    machine = EndOfTurn(SEMANTIC)
    assert machine.patience_ms == 0
    pause_ms = answered_then_going_on(machine, 608)
    assert pause_ms == 608 and machine.patience_ms == int(PATIENCE_FACTOR * 608) == 912
    # NOTE: the rest of the sentence (the turn just opened), then its end, scored sure: it waits the learned 912 ms.
    events = run(machine, [0.9] * 10 + [0.05] * 3)
    (_, pause), = events
    assert isinstance(pause, SilenceStarted)
    assert sure_commit_ms(machine, pause) == windows(912) * WINDOW_MS
    # NOTE: a pause longer than CUT_OFF_MS after a turn it ended is the speaker's turn-taking, not a cut-off
    machine = EndOfTurn(SEMANTIC)
    answered_then_going_on(machine, CUT_OFF_MS + WINDOW_MS)
    assert machine.patience_ms == 0
    # NOTE: the wait never goes past a middling score's
    machine = EndOfTurn(SEMANTIC)
    answered_then_going_on(machine, 960)
    assert machine.patience_ms == rules.min_silence_ms


def test_a_hesitation_waited_out_teaches_the_same_wait_and_a_gap_inside_a_sentence_does_not() -> None:
    """The words held a pause the speaker went on from after 608 ms: the next sure-scored pause of theirs may be
    one the words miss ("a" heard as "it"), so it waits too. A voice's gaps inside a sentence (<= ~260 ms) do not
    count."""
    machine = EndOfTurn(SEMANTIC)
    pause = speak(machine)
    assert machine.on_score(pause.token, 0.99, is_unfinished=True) == []
    events = run(machine, [0.0] * (windows(608) - 3) + [0.9, 0.9])
    assert [type(e) for _, e in events] == [SpeechResumed] and machine.patience_ms == 912
    for gap_ms, patience_ms in [(256, 0), (HESITATION_MS, int(PATIENCE_FACTOR * HESITATION_MS))]:
        machine = EndOfTurn(SEMANTIC)
        pause = speak(machine)
        run(machine, [0.0] * (windows(gap_ms) - 3) + [0.9, 0.9])
        assert machine.phase is Phase.SPEAKING and machine.patience_ms == patience_ms


def fluent_turn(machine: EndOfTurn) -> None:
    """The open turn goes on, pauses (scored sure) and ends; the speaker was done: silent for 2 s."""
    (_, pause), = run(machine, [0.9] * 10 + [0.05] * 3)
    assert isinstance(pause, SilenceStarted)
    sure_commit_ms(machine, pause)


def test_the_learned_wait_fades_with_each_turn_said_without_a_hesitation() -> None:
    machine = EndOfTurn(SEMANTIC)
    answered_then_going_on(machine, 608)
    learned = machine.patience_ms
    fluent_turn(machine)  # NOTE: the rest of the cut-off sentence: a turn with a hesitation in it
    run(machine, [0.9] * machine.num_start_windows)
    assert machine.patience_ms == learned == 912
    for _ in range(3):
        fluent_turn(machine)
        assert machine.patience_ms == learned  # NOTE: known only once the next turn opens
        run(machine, [0.9] * machine.num_start_windows)
        learned = int(learned * PATIENCE_DECAY)
        assert machine.patience_ms == learned
    assert learned == 384
    # NOTE: a turn with another hesitation keeps the wait whole (a shorter one does not lower it)
    pause = run(machine, [0.9] * 10 + [0.05] * 3)[0][1]
    assert isinstance(pause, SilenceStarted) and machine.on_score(pause.token, 0.5) == []
    run(machine, [0.0] * (windows(HESITATION_MS) - 3) + [0.9, 0.9])
    assert machine.patience_ms == max(384, int(PATIENCE_FACTOR * HESITATION_MS)) == 480
    fluent_turn(machine)
    run(machine, [0.9] * machine.num_start_windows)
    assert machine.patience_ms == 480
    # NOTE: a sure score waits whichever is longer, the eagerness's own or the learned (faded) wait
    machine.patience_ms = 64
    (_, pause), = run(machine, [0.9] * 10 + [0.05] * 3)
    assert isinstance(pause, SilenceStarted)
    assert sure_commit_ms(machine, pause) == windows(EAGERNESS["medium"].sure_silence_ms) * WINDOW_MS


def test_speech_dropped_as_no_turn_teaches_nothing() -> None:
    """Speech over a reply dismissed as a backchannel, or a cleared buffer (`reset`): its onset's lesson goes."""
    machine = EndOfTurn(SEMANTIC)
    answered_then_going_on(machine, 416)
    assert machine.patience_ms == int(PATIENCE_FACTOR * 416)
    machine.reset()
    assert machine.patience_ms == 0
    answered_then_going_on(machine, 416)
    run(machine, [0.9] * 10 + [0.05] * 3)
    machine.on_score(machine.token, 0.99)
    run(machine, [0.0] * windows(1000))  # NOTE: that turn ended: its lesson stays through a later reset
    machine.reset()
    assert machine.patience_ms == int(PATIENCE_FACTOR * 416)


def test_a_late_score_commits_at_once() -> None:
    machine = EndOfTurn(SEMANTIC)
    pause = speak(machine)
    # NOTE: no score yet: the commit waits for it, past the silence a middling score needs
    assert run(machine, [0.0] * windows(EAGERNESS["medium"].min_silence_ms)) == []
    (stopped,) = machine.on_score(pause.token, 0.7)
    assert stopped == SpeechStopped(machine.now_ms, pause.speech_end_ms)


def test_an_unfinished_turn_waits_for_the_maximum_silence() -> None:
    machine = EndOfTurn(SEMANTIC)
    pause = speak(machine)
    assert machine.on_score(pause.token, 0.2) == []
    max_windows = windows(EAGERNESS["medium"].max_silence_ms)
    events = run(machine, [0.0] * (max_windows - 3))
    (index, stopped), = events
    assert stopped.audio_end_ms - pause.speech_end_ms == max_windows * WINDOW_MS
    assert index == machine.num_windows - 1


@pytest.mark.parametrize("eagerness", ["low", "medium", "high"])
def test_unfinished_words_hold_a_finished_sounding_turn_a_bounded_while(eagerness: str) -> None:
    rules = EAGERNESS[eagerness]
    assert rules.min_silence_ms < rules.unfinished_silence_ms < rules.max_silence_ms
    machine = EndOfTurn(TurnDetectionConfig(type="semantic_vad", eagerness=eagerness))
    pause = speak(machine)
    # NOTE: even a sure score waits when the words end on "a", "the", "and"...
    assert machine.on_score(pause.token, 0.99, is_unfinished=True) == []
    (index, stopped), = run(machine, [0.0] * windows(rules.max_silence_ms))
    assert stopped.audio_end_ms - pause.speech_end_ms == windows(rules.unfinished_silence_ms) * WINDOW_MS


@pytest.mark.parametrize("eagerness", ["low", "medium", "high"])
def test_the_thinkers_reading_settles_an_unsure_score_and_a_sure_one_outweighs_it(eagerness: str) -> None:
    rules = EAGERNESS[eagerness]
    unsure = (rules.min_complete + rules.sure_complete) / 2
    # NOTE: sure, it sounds finished (and a misheard question reads as unfinished): it waits no longer than a sure
    # score does; unsure, the thinker's reading holds it as unfinished words do.
    for score, wait_ms in [(unsure, rules.unfinished_silence_ms), (rules.sure_complete, rules.sure_silence_ms)]:
        machine = EndOfTurn(TurnDetectionConfig(type="semantic_vad", eagerness=eagerness))
        pause = speak(machine)
        events = machine.on_score(pause.token, score, is_maybe_unfinished=True)
        events += [e for _, e in run(machine, [0.0] * windows(rules.max_silence_ms))]
        (stopped,) = events
        assert isinstance(stopped, SpeechStopped)
        assert stopped.audio_end_ms - pause.speech_end_ms == max(96, windows(wait_ms) * WINDOW_MS)
    # Unfinished words hold even a sure score, as before, whatever the thinker reads.
    machine = EndOfTurn(TurnDetectionConfig(type="semantic_vad", eagerness=eagerness))
    pause = speak(machine)
    assert machine.on_score(pause.token, 0.99, is_unfinished=True, is_maybe_unfinished=False) == []


def test_a_speaker_who_goes_on_within_the_unfinished_wait_keeps_the_turn() -> None:
    machine = EndOfTurn(SEMANTIC)
    pause = speak(machine)
    assert machine.on_score(pause.token, 0.99, is_unfinished=True) == []
    # NOTE: a 900 ms hesitation (less the 96 ms already silent), then the rest of the sentence.
    events = run(machine, [0.0] * windows(900 - 96) + [0.9, 0.9])
    assert [type(e) for _, e in events] == [SpeechResumed] and machine.phase is Phase.SPEAKING


def test_unfinished_words_and_an_unfinished_sound_wait_for_the_maximum_silence() -> None:
    machine = EndOfTurn(SEMANTIC)
    rules = EAGERNESS["medium"]
    pause = speak(machine)
    assert machine.on_score(pause.token, rules.min_complete - 0.01, is_unfinished=True) == []
    (index, stopped), = run(machine, [0.0] * windows(rules.max_silence_ms))
    assert stopped.audio_end_ms - pause.speech_end_ms == windows(rules.max_silence_ms) * WINDOW_MS


def test_a_resumed_speaker_voids_the_pause_and_its_score() -> None:
    machine = EndOfTurn(SEMANTIC)
    pause = speak(machine)
    resumed = run(machine, [0.9, 0.9])
    assert [type(e) for _, e in resumed] == [SpeechResumed] and machine.phase is Phase.SPEAKING
    assert machine.on_score(pause.token, 0.99) == []  # NOTE: the old pause's score is ignored
    events = run(machine, [0.9] * 5 + [0.0] * 3)
    (_, second), = events
    assert isinstance(second, SilenceStarted) and second.token != pause.token
    assert second.speech_end_ms > pause.speech_end_ms
    assert machine.on_score(second.token, 0.8) == []  # NOTE: 96 ms so far
    stopped = run(machine, [0.0] * (windows(EAGERNESS["medium"].min_silence_ms) - 3))
    assert [type(e) for _, e in stopped] == [SpeechStopped]


def test_one_speech_window_in_a_pause_does_not_resume_it() -> None:
    machine = EndOfTurn(SEMANTIC)
    pause = speak(machine)
    assert run(machine, [0.9, 0.0]) == []  # NOTE: a click: 32 ms < the 64 ms that resume
    assert machine.on_score(pause.token, 0.8) == [] and machine.phase is Phase.PAUSED
    events = run(machine, [0.0] * windows(EAGERNESS["medium"].min_silence_ms))
    (_, stopped), = events
    # NOTE: the click neither resumed the turn nor restarted its silence
    end = pause.speech_end_ms
    assert stopped == SpeechStopped(end + windows(EAGERNESS["medium"].min_silence_ms) * WINDOW_MS, end)


@pytest.mark.parametrize("eagerness", ["low", "medium", "high"])
def test_eagerness_orders_the_waits(eagerness: str) -> None:
    machine = EndOfTurn(TurnDetectionConfig(type="semantic_vad", eagerness=eagerness))
    pause = speak(machine)
    rules = EAGERNESS[eagerness]
    # NOTE: a middling score commits only where the eagerness accepts it.
    is_committed = bool(machine.on_score(pause.token, 0.6) or run(machine, [0.0] * windows(rules.min_silence_ms)))
    assert is_committed == (rules.min_complete <= 0.6)
    low, medium, high = EAGERNESS["low"], EAGERNESS["medium"], EAGERNESS["high"]
    assert low.max_silence_ms > medium.max_silence_ms > high.max_silence_ms
    assert low.min_complete > medium.min_complete > high.min_complete and EAGERNESS["auto"] == medium
    assert low.sure_complete > medium.sure_complete > high.sure_complete > high.min_complete
    assert low.min_silence_ms > medium.min_silence_ms > high.min_silence_ms


def test_a_middling_score_waits_out_a_hesitation() -> None:
    # NOTE: a voice cut after "can you tell me the" or in the gap before "milk" scores 0.64-0.90 (under sure): a
    # listener lets a hesitation's pause (the turn-taking set's: 400-900 ms) go by before answering.
    machine = EndOfTurn(SEMANTIC)
    pause = speak(machine)
    assert machine.on_score(pause.token, 0.8) == []
    assert run(machine, [0.0] * windows(900 - 96)) == [] and machine.phase is Phase.PAUSED
    assert [type(e) for _, e in run(machine, [0.9] * 2)] == [SpeechResumed]


def test_reset_forgets_the_turn_and_a_later_turn_starts_after_it() -> None:
    machine = EndOfTurn(SEMANTIC)
    pause = speak(machine)
    machine.reset()
    assert machine.phase is Phase.IDLE and machine.on_score(pause.token, 0.99) == []
    floor = machine.now_ms
    (_, started), = run(machine, [0.9] * 4)
    assert started == SpeechStarted(floor)  # NOTE: the padding stops at the reset


def test_semantic_vad_config_is_openais() -> None:
    config = TurnDetectionConfig.from_openai({"type": "semantic_vad", "eagerness": "high", "interrupt_response": False})
    assert config.is_semantic and config.rules == EAGERNESS["high"] and not config.interrupt_response
    assert TurnDetectionConfig.from_openai({"type": "semantic_vad"}).eagerness == "auto"
    with pytest.raises(ValueError, match=r"unknown key\(s\) 'silence_duration_ms' for semantic_vad"):
        TurnDetectionConfig.from_openai({"type": "semantic_vad", "silence_duration_ms": 500})
    with pytest.raises(ValueError, match=r"turn_detection\.eagerness: must be one of"):
        TurnDetectionConfig.from_openai({"type": "semantic_vad", "eagerness": "eager"})
    with pytest.raises(ValueError, match=r"turn_detection\.eagerness"):
        TurnDetectionConfig(type="semantic_vad", eagerness=["low"])  # type: ignore[arg-type]


@pytest.mark.parametrize(("words", "is_more"), [
    ("i would like to book a", True), ("my name is john and", True), ("I'd like the", True), ("so um", True),
    ("what is the capital of france", False), ("what is it for", False), ("yes i can", False), ("", False),
    ("thank you", False), ("Because.", True)])
def test_words_that_cannot_end_a_sentence_hold_the_turn_open(words: str, is_more: bool) -> None:
    assert words_suggest_more(words) is is_more


@pytest.mark.parametrize(("turn_end_p", "is_more"), [(None, False), (0.0, True), (0.0019, True), (0.002, False),
                                                    (0.9, False)])
def test_the_thinkers_reading_of_the_words_holds_the_turn_under_its_threshold(turn_end_p: float | None,
                                                                               is_more: bool) -> None:
    assert text_suggests_more(turn_end_p) is is_more


@pytest.mark.parametrize(("final", "partial", "alternatives", "is_more"), [
    ("i would like to book it", "", ["i would like to cook it", "i would like to book a"], True),  # an alternative
    ("can you tell me that", "can you tell me the", [], True),  # the partial kept the dangling word
    ("i want to know the name", "", ["i want to know the name of"], True),  # longer than a 5-word final: counts
    ("yeah", "", ["yeah and", "yan"], False),  # a short answer's alternatives add a word: ignored
    ("okay", "", ["ok", "okay a"], False),
    ("what is the capital of france", "what is the capital of france", ["what is the capital of friends"], False),
    ("i need to buy some milk and", "", [], True)])
def test_every_hypothesis_of_the_turn_is_read(final: str, partial: str, alternatives: list[str], is_more: bool) -> None:
    assert hypotheses_suggest_more(final, partial, alternatives) is is_more


@pytest.mark.parametrize(("final", "partial", "alternatives", "turn_end_p", "wideband", "narrowband"), [
    # Logged on /twilio/media: "What is the capital of France?", Smart Turn 0.989; only an alternative dangles.
    ("what if the capital of france", "what if the capital of france",
     ["what if the capital of free and", "what if the capital of france"], 0.3, (True, False), (False, True)),
    # The final or the partial dangles: unfinished on any line ("could you help me find a,").
    ("could you help me find him", "could you help me find a", [], 0.2, (True, False), (True, False)),
    # An alternative that only adds a dangling word to the final stays strong on a phone line ("the name, of").
    ("i want to know the name", "i want to know the name", ["i want to know the name of", "i want to know the game"],
     0.3, (True, False), (True, False)),
    ("i need to buy some milk and", "", ["i need to buy some milk in"], 0.5, (True, False), (True, False)),
    # The thinker's reading alone is weak evidence on any line.
    ("can you tell me that", "can you tell me that", [], 0.0015, (False, True), (False, True)),
    ("who wrote romeo and juliet", "who wrote romeo and juliet", ["who wrote romeo and julie"], None,
     (False, False), (False, False)),
])
def test_a_phone_lines_alternatives_are_weak_evidence_and_a_wideband_lines_strong(
        final: str, partial: str, alternatives: list[str], turn_end_p: float | None, wideband: tuple[bool, bool],
        narrowband: tuple[bool, bool]) -> None:
    assert read_pause_words(final, partial, alternatives, turn_end_p, is_narrowband=False) == wideband
    assert read_pause_words(final, partial, alternatives, turn_end_p, is_narrowband=True) == narrowband


@pytest.mark.parametrize("is_narrowband", [False, True])
def test_a_sure_score_outweighs_a_phone_lines_alternatives_and_not_a_wideband_lines(is_narrowband: bool) -> None:
    rules = EAGERNESS["medium"]
    machine = EndOfTurn(SEMANTIC)
    pause = speak(machine)
    words = read_pause_words("what color is the guy", "what color is the guy", ["what color is the and"], 0.5,
                             is_narrowband=is_narrowband)
    assert machine.on_score(pause.token, 0.98, *words) == []
    (index, stopped), = run(machine, [0.0] * windows(rules.max_silence_ms))
    wait_ms = rules.sure_silence_ms if is_narrowband else rules.unfinished_silence_ms  # NOTE: as any sure score
    assert stopped.audio_end_ms - pause.speech_end_ms == windows(wait_ms) * WINDOW_MS
