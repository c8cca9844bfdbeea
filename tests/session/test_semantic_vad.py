"""`SemanticTurnDetector` over the real models (Silero VAD, Smart Turn) on speech synthesised at test
time: a question ends its turn soon after the last word, a noise burst or a cough opens none, any input
rate gives the same timeline, bad input is refused, and `make_detector` picks the detector by type."""

from __future__ import annotations

import numpy as np
import pytest
from speech_text import ASR_RATE, speech

from voice_server.audio import float32_to_pcm16, frame_levels_db, resample_signal
from voice_server.session.config import SessionConfig
from voice_server.session.detectors import make_detector
from voice_server.session.end_of_turn import OnsetHeard, OnsetLost, SilenceStarted
from voice_server.session.semantic_vad import SILENT_DB, SemanticTurnDetector
from voice_server.session.turn_config import TurnDetectionConfig
from voice_server.session.vad import SpeechStarted, SpeechStopped, TurnDetector

SEMANTIC = TurnDetectionConfig(type="semantic_vad")


def feed_all(detector: SemanticTurnDetector, audio: np.ndarray, rate: int) -> list[tuple[int, object]]:
    """(input ms at which each event came, event), 20 ms chunks, each pause scored at once; onsets left out
    (`OnsetHeard`/`OnsetLost`: what a reply playing would do, not the turn)."""
    pcm, step, out = float32_to_pcm16(audio), rate // 50, []
    for i in range(0, pcm.size, step):
        for event in detector.feed(pcm[i:i + step]):
            if isinstance(event, OnsetHeard | OnsetLost):
                continue
            now_ms = (i + step) * 1000 // rate
            out.append((now_ms, event))
            if isinstance(event, SilenceStarted):
                start = detector.turn_start_ms or 0
                scored = detector.on_score(event.token, detector.score(pcm[start * rate // 1000: i + step]))
                out.extend((now_ms, e) for e in scored)
    return out


def room(ms: int, rate: int = ASR_RATE, seed: int = 0) -> np.ndarray:
    """An open microphone's floor: -60 dBFS of noise."""
    return (1e-3 * np.random.default_rng(seed).standard_normal(rate * ms // 1000)).astype(np.float32)


def first_loud_ms(audio: np.ndarray, rate: int) -> int:
    return int(np.flatnonzero(frame_levels_db(audio, rate) >= -40.0)[0]) * 10


def last_loud_ms(audio: np.ndarray, rate: int) -> int:
    return int(np.flatnonzero(frame_levels_db(audio, rate) >= -40.0)[-1] + 1) * 10


@pytest.mark.parametrize(("noise_db", "quiet_ms"), [(-60.0, 0), (-40.0, 0), (-40.0, 3000)])
def test_a_question_ends_its_turn_soon_after_the_last_word(noise_db: float, quiet_ms: int) -> None:
    """On a quiet room and on a line with noise 20 dB under the speech (-40 dBFS: the quiet gate follows
    the floor; a fixed -50 dBFS gate never fired there, leaving Silero's 60-200 ms lag in the pause), also
    where the noise starts 0.3 s before the words, after `quiet_ms` of a quiet room (the floor follows the
    latest non-speech: over ~2 s of it, the room's -60 dBFS held the gate down through the question)."""
    clean = speech("What is the capital of France?", silence_s=0.0)
    clean = np.concatenate([clean, np.zeros(ASR_RATE // 2, np.float32)])  # NOTE: the commit's silence
    level = 10 * np.log10(np.mean(clean[np.abs(clean) > 1e-3] ** 2))
    clean = clean * np.float32(10 ** ((-20.0 - level) / 20))
    clean_ms = clean.size * 1000 // ASR_RATE
    # NOTE: a second of the line's noise before the words, or (after a quiet room) 0.3 s of it
    noise = room(1000 + clean_ms if quiet_ms == 0 else 300 + clean_ms - first_loud_ms(clean, ASR_RATE))
    audio = np.concatenate([room(quiet_ms, seed=1), noise * np.float32(10 ** ((noise_db + 60.0) / 20))])
    audio[-clean.size:] += clean
    detector = SemanticTurnDetector(SEMANTIC, ASR_RATE)
    events = feed_all(detector, audio, ASR_RATE)
    kinds = [type(e) for _, e in events]
    assert kinds == [SpeechStarted, SilenceStarted, SpeechStopped], events
    assert detector.gate.level_db >= noise_db + 2  # NOTE: the gate follows the floor
    end_ms = audio.size * 1000 // ASR_RATE - clean.size * 1000 // ASR_RATE + last_loud_ms(clean, ASR_RATE)
    stopped_at, stopped = events[-1]
    assert isinstance(stopped, SpeechStopped)
    # NOTE: the quiet gate puts the end of speech within a window of the last loud frame, and the commit
    # comes at the eagerness's minimum silence after it (the score was in at the pause).
    assert abs(stopped.speech_end_ms - end_ms) <= 64, (stopped, end_ms)
    paused_at = next(at for at, e in events if isinstance(e, SilenceStarted))
    assert paused_at - end_ms <= 96 + 48, (events, end_ms)  # NOTE: the pause's three windows, and one more
    assert stopped_at - end_ms <= SEMANTIC.rules.min_silence_ms + 96


@pytest.mark.parametrize("kind", ["burst", "cough"])
def test_a_noise_burst_or_a_cough_opens_no_turn(kind: str) -> None:
    rng = np.random.default_rng(1)
    if kind == "burst":
        sound = (10 ** (-25 / 20) * rng.standard_normal(ASR_RATE * 180 // 1000)).astype(np.float32)
    else:
        t = np.arange(ASR_RATE * 300 // 1000) / ASR_RATE
        envelope = np.minimum(t / 0.03, 1.0) * np.exp(-t / 0.08)
        sound = (0.3 * envelope * rng.standard_normal(t.size)).astype(np.float32)
    audio = np.concatenate([room(500), sound, room(1500, seed=2)])
    assert feed_all(SemanticTurnDetector(SEMANTIC, ASR_RATE), audio, ASR_RATE) == []


class CountingSession:
    """Silero's shared `InferenceSession`, counting the windows it scores (the detector under test is real)."""

    def __init__(self, session: object) -> None:
        self.session, self.num_runs = session, 0

    def run(self, *args: object, **kwargs: object) -> object:
        self.num_runs += 1
        return self.session.run(*args, **kwargs)  # type: ignore[attr-defined]


def counting_detector() -> tuple[SemanticTurnDetector, CountingSession]:
    detector = SemanticTurnDetector(SEMANTIC, ASR_RATE)
    counter = CountingSession(detector._vad.session)
    detector._vad.session = counter  # type: ignore[assignment]
    return detector, counter


def test_silence_with_no_turn_open_costs_no_model_call() -> None:
    """An open microphone under `SILENT_DB` is not scored while no turn is open; a turn's own pauses are
    (the gate and the pause need their probabilities), and the turn's events are those of a detector that
    scores every window."""
    question = speech("How many legs does a spider have?", silence_s=0.0)
    quiet = room(2000) * np.float32(10 ** ((SILENT_DB - 10 + 60) / 20))  # NOTE: 10 dB under SILENT_DB
    audio = np.concatenate([quiet, question, quiet])
    detector, counter = counting_detector()
    feed_all(detector, quiet, ASR_RATE)
    assert counter.num_runs == 0
    detector, counter = counting_detector()
    events = feed_all(detector, audio, ASR_RATE)
    num_windows = audio.size // 512
    every, every_counter = counting_detector()
    every.silent_db = -np.inf
    every_events = feed_all(every, audio, ASR_RATE)
    assert [type(e) for _, e in events] == [SpeechStarted, SilenceStarted, SpeechStopped]
    # NOTE: scoring every window, Silero's lag after the last word (its state still "speech") opened a second,
    # empty turn right after this quick commit; a window under SILENT_DB opens none.
    assert [(type(e), vars(e)) for _, e in events] == [(type(e), vars(e)) for _, e in every_events[:3]]
    assert every_counter.num_runs == num_windows
    # NOTE: the question and its pause, up to the commit, and the windows replayed before its onset
    assert counter.num_runs < num_windows - 2000 // 32


@pytest.mark.parametrize("rate", [8000, 24000, 48000])
def test_every_input_rate_gives_the_same_timeline(rate: int) -> None:
    audio = speech("How many legs does a spider have?", silence_s=0.5)
    base = [(type(e), getattr(e, "audio_start_ms", None)) for _, e in feed_all(
        SemanticTurnDetector(SEMANTIC, ASR_RATE), audio, ASR_RATE)]
    other = [(type(e), getattr(e, "audio_start_ms", None)) for _, e in feed_all(
        SemanticTurnDetector(SEMANTIC, rate), resample_signal(audio, ASR_RATE, rate), rate)]
    assert [kind for kind, _ in other] == [kind for kind, _ in base]
    assert abs((other[0][1] or 0) - (base[0][1] or 0)) <= 64  # NOTE: within two windows


def test_bad_input_is_refused() -> None:
    detector = SemanticTurnDetector(SEMANTIC, ASR_RATE)
    with pytest.raises(ValueError, match="1-D float32 or int16"):
        detector.feed(np.zeros((2, 160), np.float32))
    with pytest.raises(ValueError, match="non-finite"):
        detector.feed(np.array([0.0, np.nan], np.float32))
    with pytest.raises(ValueError, match="input_rate"):
        SemanticTurnDetector(SEMANTIC, 11025)
    with pytest.raises(ValueError, match="semantic_vad"):
        SemanticTurnDetector(TurnDetectionConfig(), ASR_RATE)


def test_the_session_config_picks_the_detector() -> None:
    assert isinstance(make_detector(SessionConfig(turn_detection=SEMANTIC)), SemanticTurnDetector)
    assert isinstance(make_detector(SessionConfig()), TurnDetector)
    assert make_detector(SessionConfig(turn_detection=None)) is None
