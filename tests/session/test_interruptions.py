"""The interruption rule: speech over a reply is confirmed by words that are not backchannels or by
enough speech, and dismissed when the speaker falls silent first or nothing is confirmed in time."""

from __future__ import annotations

import pytest

from voice_server.session.interruptions import Interruption, InterruptionRules, Verdict, judge, num_content_words

RULES = InterruptionRules()
PENDING = Interruption("resp_1", "item_1", audio_start_ms=4000, started_at=100.0, run=None)


@pytest.mark.parametrize(("words", "num"), [
    ("uh huh", 0), ("Uh-huh.", 0), ("yeah right okay", 0), ("mm-hmm", 0), ("i see", 0),
    ("wait stop", 2), ("no that is wrong", 4), ("yeah but what about paris", 4), ("", 0)])
def test_backchannels_are_not_content_words(words: str, num: int) -> None:
    assert num_content_words(words) == num


@pytest.mark.parametrize(("speech_ms", "words", "silence_ms", "after_s", "verdict"), [
    (200, "wait stop", 0, 0.2, Verdict.CONFIRMED),  # NOTE: words confirm before min_speech_ms
    (640, "", 0, 0.7, Verdict.CONFIRMED),  # NOTE: enough speech confirms without a transcript
    (300, "uh huh", 256, 0.6, Verdict.DISMISSED),  # NOTE: a backchannel falls silent first
    (300, "sorry", 96, 0.4, None),  # NOTE: a comma's pause inside an interruption: still open
    (300, "yeah", 0, 2.0, Verdict.DISMISSED),  # NOTE: nothing confirmed within twice max_wait_ms
    (300, "yeah", 0, 0.5, None),  # NOTE: still open
    (640, "", 300, 0.7, Verdict.CONFIRMED),  # NOTE: confirmation wins over a pause seen at the same moment
    (300, "Wait,", 300, 0.5, Verdict.CONFIRMED),  # NOTE: one word asking to stop, its comma's pause long
    (300, "stop", 0, 0.3, Verdict.CONFIRMED),
    (300, "waiter", 0, 0.3, None),  # NOTE: whole words only
    (300, "feel", 300, 0.5, None),  # NOTE: one content word ("Wait," misheard) waits for the rest...
    (300, "feel", 300, 1.0, Verdict.DISMISSED),  # NOTE: ...up to max_wait_ms
    (300, "", 300, 0.5, Verdict.DISMISSED),  # NOTE: no word it is sure of (a cough, a misheard "uh huh")
])
def test_the_verdict(speech_ms: int, words: str, silence_ms: int, after_s: float, verdict: Verdict | None) -> None:
    assert judge(PENDING, RULES, speech_ms=speech_ms, words=words, silence_ms=silence_ms,
                 now=PENDING.started_at + after_s) is verdict


def test_words_heard_unsure_keep_a_pause_from_dismissing_until_max_wait() -> None:
    """A call's "Wait," heard as "sleep" (posterior 0.04): not a word the recogniser is sure of, but not a
    backchannel either. Dismissed at its comma, the reply played on until "stop" paused it again."""
    at = PENDING.started_at
    assert judge(PENDING, RULES, speech_ms=300, words="", silence_ms=300, now=at + 0.5, heard="sleep") is None
    assert judge(PENDING, RULES, speech_ms=300, words="", silence_ms=300, now=at + 1.0,
                 heard="sleep") is Verdict.DISMISSED
    # NOTE: unsure backchannel words, or nothing heard at all, dismiss at the pause as before
    for heard in ("yeah", ""):
        assert judge(PENDING, RULES, speech_ms=300, words="", silence_ms=300, now=at + 0.5,
                     heard=heard) is Verdict.DISMISSED


def test_a_silence_waits_for_the_words_on_their_way_but_not_past_max_wait() -> None:
    """A pause's final transcript is what confirms by words: a silence does not dismiss before it is in."""
    at = PENDING.started_at
    assert judge(PENDING, RULES, speech_ms=300, words="", silence_ms=300, now=at + 0.6, is_words_pending=True) is None
    assert judge(PENDING, RULES, speech_ms=300, words="wait stop", silence_ms=320, now=at + 0.62) is Verdict.CONFIRMED
    assert judge(PENDING, RULES, speech_ms=300, words="", silence_ms=700, now=at + 1.0,
                 is_words_pending=True) is Verdict.DISMISSED


def test_max_wait_dismisses_at_a_pause_not_mid_speech() -> None:
    """Past max_wait_ms, speech that goes on is not dismissed: "Wait, stop, I have..." heard as "we got",
    dismissed in its second comma's pause, resumed the reply for 60 ms before "I have" paused it again."""
    at = PENDING.started_at
    assert judge(PENDING, RULES, speech_ms=576, words="we got", silence_ms=160, now=at + 1.0) is None
    assert judge(PENDING, RULES, speech_ms=608, words="", silence_ms=0, now=at + 1.1) is Verdict.CONFIRMED
    assert judge(PENDING, RULES, speech_ms=576, words="we got", silence_ms=256, now=at + 1.1) is Verdict.DISMISSED
    # NOTE: nothing holds a reply past twice max_wait_ms (noise hovering at the VAD's threshold)
    assert judge(PENDING, RULES, speech_ms=320, words="", silence_ms=0, now=at + 1.9) is None
    assert judge(PENDING, RULES, speech_ms=320, words="", silence_ms=0, now=at + 2.0) is Verdict.DISMISSED


@pytest.mark.parametrize("kwargs", [{"min_words": 0}, {"min_speech_ms": -1}, {"max_wait_ms": 50.0}])
def test_rules_are_validated(kwargs: dict[str, object]) -> None:
    with pytest.raises(ValueError, match="InterruptionRules"):
        InterruptionRules(**kwargs)  # type: ignore[arg-type]
