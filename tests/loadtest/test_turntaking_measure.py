"""The turn-taking benchmark's measurement (`loadtest/bench_turntaking.py`, `loadtest/turntaking_set.py`) on
synthetic tracks, no server: the player model (queue, flush, pause/resume), onsets from levels, and each
scenario's verdict."""

from __future__ import annotations

import sys
from collections import Counter
from pathlib import Path

import numpy as np
import numpy.typing as npt
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "loadtest"))
from bench_turntaking import (  # noqa: E402
    audible_end,
    barge_in_stop_ms,
    goals,
    interruption_verdict,
    is_premature,
    latency_ms,
    onset_after,
    reply_gap_ms,
    session_questions,
)
from turntaking_set import (  # noqa: E402
    FRAME_S,
    RATE,
    Item,
    Playout,
    Track,
    Utterance,
    active_level_db,
    noise_burst,
    stretch_pause,
)

OUT = 24000


def tone(seconds: float, db: float = -20.0) -> npt.NDArray[np.float32]:
    t = np.arange(int(seconds * OUT)) / OUT
    return (np.sqrt(2) * 10 ** (db / 20) * np.sin(2 * np.pi * 220 * t)).astype(np.float32)


def quiet(seconds: float) -> npt.NDArray[np.float32]:
    return np.zeros(int(seconds * OUT), np.float32)


def said(category: str, at: float, speech_s: tuple[float, float] = (0.3, 1.0), role: str = "event") -> Utterance:
    """An item whose speech spans `speech_s` of it, its first frame spoken from `at` (frames sent on time)."""
    audio = np.zeros(int((speech_s[1] + 0.3) * RATE), np.float32)
    item = Item(category, category, audio, (int(speech_s[0] * RATE), int(speech_s[1] * RATE)))
    num_frames = -(-audio.size // int(RATE * FRAME_S))
    return Utterance(item, role, [at + FRAME_S * (k + 1) for k in range(num_frames)])


def track_of(playout: Playout, *utterances: Utterance, statuses: dict[str, tuple[float, str]] | None = None) -> Track:
    return Track("ws", playout.heard(), playout.flushes, playout.pauses, statuses or {}, list(utterances), [])


def reply(seconds: float = 6.0, arrival: float = 10.0, key: str = "r1") -> Playout:
    """A reply that arrives at once (faster than real time, as generation runs) and is heard from `arrival`."""
    playout = Playout(OUT)
    playout.add(tone(seconds), arrival, key)
    return playout


def test_sessions_asking_every_question_ask_each_equally_often_from_their_own_on() -> None:
    items = [Item("complete", f"q{i}", np.zeros(RATE, np.float32), (0, RATE)) for i in range(12)]
    asked = [session_questions(items, i) for i in range(8)]
    assert [q.name for q in asked[3][:3]] == ["q3", "q4", "q5"]
    counts = Counter(q.name for questions in asked for q in questions)
    assert set(counts.values()) == {8} and len(counts) == 12
    # NOTE: the runs before asked two a session: q1..q7 twice, q0 and q8 once, q9..q11 never
    two = Counter(q.name for i in range(8) for q in session_questions(items, i, 2))
    assert two["q1"] == 2 and two["q0"] == 1 and "q9" not in two


def test_chunks_queue_behind_what_plays_and_gaps_wait_for_arrival() -> None:
    playout = Playout(OUT)
    playout.add(tone(1.0), 10.0, "r")
    playout.add(tone(0.5), 10.2, "r")  # NOTE: arrives while the first plays: heard after it
    playout.add(tone(0.5), 12.0, "r")  # NOTE: arrives after the queue ran dry: heard at arrival
    assert [round(s.start, 3) for s in playout.segments] == [10.0, 11.0, 12.0]
    assert playout.end == pytest.approx(12.5)
    assert playout.played_s("r", 11.2) == pytest.approx(1.2)
    heard = playout.heard()
    assert heard.starts[0] == 10.0 and heard.starts.size == 200
    assert audible_end(heard, "r") == pytest.approx(12.5)
    assert onset_after(heard, 11.55) == pytest.approx(12.0)


def test_a_flush_drops_the_queue_at_that_moment() -> None:
    playout = reply(2.0, arrival=0.0)
    assert playout.flush(0.5) == pytest.approx(1.5)
    assert playout.end == pytest.approx(0.5)
    playout.add(tone(0.2), 0.6, "r2")
    assert playout.segments[-1].start == pytest.approx(0.6)
    heard = playout.heard()
    assert audible_end(heard, "r1") == pytest.approx(0.5)
    assert audible_end(heard, "r2") == pytest.approx(0.8)


def test_a_pause_holds_the_queue_until_the_resume() -> None:
    playout = reply(1.0, arrival=0.0)
    playout.pause(0.4, "r1")
    playout.add(tone(0.5), 0.6, "r1")  # NOTE: arrives during the pause: waits behind the rest
    assert playout.played_s("r1", 0.9) == pytest.approx(0.4)
    playout.resume(1.0)
    assert [(round(s.start, 3), s.samples.size / OUT) for s in playout.segments] == [
        (0.0, 0.4), (1.0, 0.6), (1.6, 0.5)]
    assert playout.end == pytest.approx(2.1)
    assert playout.pauses == [(0.4, 1.0, "r1")]
    heard = playout.heard()
    assert onset_after(heard, 0.41) == pytest.approx(1.0)  # NOTE: nothing is heard during the pause


def test_a_flush_while_paused_drops_everything_not_heard_before_the_pause() -> None:
    playout = reply(1.0, arrival=0.0)
    playout.pause(0.3, "r1")
    assert playout.flush(0.8) == pytest.approx(0.7)
    assert playout.paused_at is None and playout.pauses == [(0.3, 0.8, "r1")]
    assert audible_end(playout.heard(), "r1") == pytest.approx(0.3)


def test_latency_counts_from_the_end_of_speech_to_the_first_audible_frame() -> None:
    question = said("complete", 5.0, (0.3, 1.5), role="question")  # NOTE: speech ends at 6.5
    playout = Playout(OUT)
    # NOTE: the reply's first 100 ms are near-silence (-60 dBFS): heard, not audible
    playout.add(np.concatenate([tone(0.1, db=-60), tone(1.0)]), 6.7, "r1")
    track = track_of(playout, question)
    assert latency_ms(track, question) == pytest.approx(300, abs=1)
    assert latency_ms(track_of(Playout(OUT), question), question) is None


def test_a_reply_heard_in_the_hesitation_is_premature_and_one_after_the_sentence_is_not() -> None:
    hesitation = said("hesitation", 5.0, (0.3, 3.0), role="question")  # NOTE: the sentence ends at 8.0
    early = Playout(OUT)
    early.add(tone(1.0), 6.8, "r1")
    assert is_premature(track_of(early, hesitation), hesitation)
    late = Playout(OUT)
    late.add(tone(1.0), 8.4, "r1")
    assert not is_premature(track_of(late, hesitation), hesitation)
    assert latency_ms(track_of(late, hesitation), hesitation) == pytest.approx(400, abs=1)


def test_a_reply_that_plays_on_through_a_cough_is_kept() -> None:
    cough = said("cough", 11.0)  # NOTE: its onset at 11.3, while the reply plays until 16.0
    assert interruption_verdict(track_of(reply(), cough), cough) == "kept"


def test_a_reply_flushed_after_a_cough_is_stopped() -> None:
    cough = said("cough", 11.0)
    playout = reply()
    playout.flush(11.7)
    assert interruption_verdict(track_of(playout, cough), cough) == "stopped"
    # NOTE: the same flush 2.5 s after the onset (the user cut the reply short) is not the cough's doing
    late = reply()
    late.flush(13.9)
    assert interruption_verdict(track_of(late, cough), cough) == "kept"


def test_a_reply_the_server_cancelled_after_a_backchannel_is_stopped() -> None:
    backchannel = said("backchannel", 11.0)
    track = track_of(reply(), backchannel, statuses={"r1": (12.0, "cancelled")})
    assert interruption_verdict(track, backchannel) == "stopped"


def test_a_reply_paused_and_resumed_went_on() -> None:
    burst = said("burst", 11.0)
    playout = reply()
    playout.pause(11.5, "r1")
    playout.resume(12.4)
    assert interruption_verdict(track_of(playout, burst), burst) == "paused"
    assert reply_gap_ms(track_of(playout, burst), burst) == pytest.approx(900, abs=10)  # NOTE: what the listener waited
    assert reply_gap_ms(track_of(reply(), burst), burst) is None
    left = reply()
    left.pause(11.5, "r1")  # NOTE: never resumed and nothing more heard: the reply stopped there
    assert interruption_verdict(track_of(left, burst), burst) == "stopped"


def test_a_reply_with_its_own_quiet_stretch_is_kept_and_one_that_ran_out_is_not_judged() -> None:
    cough = said("cough", 11.0)
    playout = Playout(OUT)
    playout.add(np.concatenate([tone(1.5), quiet(0.5), tone(3.0)]), 10.0, "r1")  # NOTE: quiet 11.5-12.0
    assert interruption_verdict(track_of(playout, cough), cough) == "kept"
    assert interruption_verdict(track_of(reply(1.0), cough), cough) == "ended"  # NOTE: over at 11.0
    assert interruption_verdict(track_of(reply(1.8), cough), cough) == "ended"  # NOTE: ran out at 11.8


def test_barge_in_stop_is_the_end_of_the_audible_reply_after_the_first_word() -> None:
    barge_in = said("barge_in", 11.0)  # NOTE: first word at 11.3
    playout = reply()
    playout.flush(11.55)
    playout.add(tone(1.0), 13.0, "r2")  # NOTE: the answer to the interruption: another response
    assert barge_in_stop_ms(track_of(playout, barge_in), barge_in) == pytest.approx(250, abs=1)
    assert barge_in_stop_ms(track_of(reply(), barge_in), barge_in) == pytest.approx(4700, abs=1)
    assert barge_in_stop_ms(track_of(reply(1.0), barge_in), barge_in) is None


def test_an_utterance_maps_its_samples_to_when_they_were_spoken_even_when_frames_went_out_late() -> None:
    utterance = said("complete", 0.0)
    utterance.send_times[30:] = [t + 0.1 for t in utterance.send_times[30:]]  # NOTE: the mic stalled 100 ms
    assert utterance.at(0.3) == pytest.approx(0.3)
    assert utterance.at(0.7) == pytest.approx(0.8)
    assert utterance.speech_end_at == pytest.approx(1.1)


def test_a_pause_is_stretched_at_the_gap_near_where_the_first_words_end() -> None:
    rng = np.random.default_rng(0)
    voice = np.concatenate([rng.standard_normal(8000) * 0.1, np.zeros(480), rng.standard_normal(4000) * 0.1,
                            np.zeros(800), rng.standard_normal(8000) * 0.1]).astype(np.float32)
    out, (start, end) = stretch_pause(voice, 0.6, expected_s=0.8)  # NOTE: the 30 ms gap at 0.5 s lies too early
    assert (start, end - start) == (12480, 9600)
    assert np.all(out[start:end] == 0) and out.size == voice.size - 800 + 9600
    assert active_level_db(noise_burst(rng)) == pytest.approx(-25, abs=0.3)


def test_goals_are_met_only_with_enough_items() -> None:
    rows = {"complete": [{"endpoint": "ws", "sessions": 1, "p50_ms": 280.0, "p90_ms": 450.0},
                         {"endpoint": "twilio", "sessions": 1, "p50_ms": 300.0, "p90_ms": 600.0}],
            "interruptions": [{"endpoint": "ws", "kind": "cough", "num_items": 22, "num_reply_ended": 2,
                               "num_stopped": 0},
                              {"endpoint": "ws", "kind": "burst", "num_items": 3, "num_reply_ended": 1,
                               "num_stopped": 0},
                              {"endpoint": "ws", "kind": "backchannel", "num_items": 3, "num_reply_ended": 0,
                               "num_stopped": 1}],
            "barge_in": [{"endpoint": "ws", "num_items": 3, "num_reply_ended": 3, "num_within_300ms": 0}]}
    verdicts = {(g["goal"].split(" (")[0], g["endpoint"]): g["verdict"] for g in goals(rows)}
    assert verdicts[("reply p50 <= 300 ms, p90 <= 500 ms", "ws")] == "met"
    assert verdicts[("reply p50 <= 300 ms, p90 <= 500 ms", "twilio")] == "not met"
    assert verdicts[("twilio p90 <= 1.3x /ws", "twilio")] == "not met"  # NOTE: 600 / 450 = 1.33
    assert verdicts[("0 stopped replies of >= 20 coughs", "ws")] == "met"
    assert verdicts[("0 stopped replies of >= 20 bursts", "ws")] == "too few items"
    assert verdicts[("0 stopped replies of >= 20 backchannels", "ws")] == "not met"  # NOTE: one stop fails it
    assert verdicts[("every barge-in stops audible audio <= 300 ms", "ws")] == "no data"
