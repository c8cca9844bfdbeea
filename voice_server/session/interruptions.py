"""Is speech over a reply an interruption? The rule (`InterruptionRules`) and the pending state
(`Interruption`) that `Responses` (`responses.py`) acts on.

People talk over a speaker all the time without taking the turn: "uh huh", "yeah", "right", a cough, a
laugh. A voice agent that stops for each of these feels broken (peers' users' top complaint), one that
never stops feels deaf. So speech over a reply pauses it at once and is then judged:

- confirmed, the reply is cut: `min_words` recognised words that are not backchannels, or one word that
  asks the speaker to stop (`STOP_WORDS`) (where the pipeline transcribes while the user speaks: the final
  transcript at the speaker's first pause, only the words the recogniser is sure of), or `min_speech_ms` of
  speech (VAD windows);
- dismissed, the reply resumes: the speaker fell silent first, for `dismiss_silence_ms` (a backchannel is
  short; "Sorry, can you..." pauses at its comma and goes on), the pause's words are in and none of them
  is a content word, sure or not (a word it is unsure of is no evidence of a backchannel: a call's "Wait,"
  heard as "sleep" at 0.04 was dismissed at its comma, and the reply played on until "stop" paused it again,
  680 ms after the first word), or nothing was confirmed within `max_wait_ms` of the onset and the speaker then
  pauses for `dismiss_silence_ms` (or nothing within twice that: noise hovering at the VAD's threshold
  holds no reply longer). Not at `max_wait_ms` itself: "Wait, stop, I have..." heard as "we got" (one
  content word) was dismissed in its second comma's pause, 1 s in, and paused again 60 ms later; speech
  that goes on confirms by its length instead. One content word waits
  for the rest: the recogniser hears the "Wait," of "Wait, stop, I have another question." as "feel",
  and dismissing it at its comma resumed the reply for ~0.4 s before "stop" paused it again.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from voice_server.session.response import ResponseRun

__all__ = ["BACKCHANNELS", "STOP_WORDS", "Interruption", "InterruptionRules", "Verdict", "judge", "num_content_words"]

BACKCHANNELS = frozenset([
    "uh", "huh", "uhhuh", "mm", "mhm", "mmhmm", "hm", "hmm", "um", "ah", "oh", "yeah", "yes", "yep", "ya", "yup",
    "right", "okay", "ok", "sure", "alright", "i", "see", "got", "it", "wow", "cool", "great", "really", "true",
    "exactly", "nice", "indeed",
])
"""What a listener says to keep the speaker going; none of them counts toward `min_words`."""

STOP_WORDS = frozenset(["wait", "stop", "pause"])
"""Words that ask the speaker to stop: one alone confirms ("Wait," then a comma's pause)."""


@dataclass(frozen=True)
class InterruptionRules:
    min_words: int = 2
    min_speech_ms: int = 600
    dismiss_silence_ms: int = 250
    max_wait_ms: int = 1000

    def __post_init__(self) -> None:
        for name, low, high in (("min_words", 1, 20), ("min_speech_ms", 0, 5000), ("dismiss_silence_ms", 0, 5000),
                                ("max_wait_ms", 100, 10_000)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
                raise ValueError(f"InterruptionRules.{name} must be an integer in [{low}, {high}], got {value!r}")


class Verdict(enum.Enum):
    CONFIRMED = "confirmed"
    DISMISSED = "dismissed"


@dataclass(frozen=True)
class Interruption:
    """Speech that started over a reply (its response `response_id`), not yet judged."""

    response_id: str
    item_id: str
    """The user item the speech becomes if confirmed."""
    audio_start_ms: int
    started_at: float
    """When the reply was paused (monotonic)."""
    run: ResponseRun | None
    """The response held while generating; None when it had finished and only played at the client."""


def _words(transcript: str) -> list[str]:
    return [word.strip(".,!?;:\"") for word in transcript.lower().replace("-", "").replace("'", "").split()]


def num_content_words(transcript: str) -> int:
    """Words that are not backchannels ("uh huh yeah" has none, "wait stop" two)."""
    return sum(1 for word in _words(transcript) if word not in BACKCHANNELS)


def judge(pending: Interruption, rules: InterruptionRules, *, speech_ms: int, words: str, silence_ms: int,
          now: float, is_words_pending: bool = False, heard: str = "") -> Verdict | None:
    """The verdict on `pending` so far (`words`: what the recogniser is sure of; `heard`: all it heard, the
    words it is unsure of too; `silence_ms`: how long the speaker has been silent, 0 while they speak;
    `is_words_pending`: the recogniser is still transcribing up to the pause), or None while it is still open."""
    said = _words(words)
    num_content = num_content_words(words)
    if num_content >= rules.min_words or not STOP_WORDS.isdisjoint(said) or speech_ms >= rules.min_speech_ms:
        return Verdict.CONFIRMED
    waited_ms = (now - pending.started_at) * 1000.0
    is_pause = silence_ms >= rules.dismiss_silence_ms
    if waited_ms >= 2 * rules.max_wait_ms or (waited_ms >= rules.max_wait_ms and is_pause):
        return Verdict.DISMISSED
    if is_pause and not is_words_pending and num_content == 0 and num_content_words(heard) == 0:
        return Verdict.DISMISSED
    return None
