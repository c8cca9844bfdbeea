"""PlaybackTracker: scripted send/echo/clear sequences against the played-audio rule in playback.py."""

from __future__ import annotations

import random

import pytest

from voice_server.session.twilio import NUM_FRAME_SAMPLES, PlaybackTracker


def send_frames(tracker: PlaybackTracker, num_frames: int, num_samples: int = NUM_FRAME_SAMPLES) -> list[str]:
    """Send ``num_frames`` media frames; the marks the tracker asked for, in order."""
    marks = [tracker.on_media_sent(num_samples) for _ in range(num_frames)]
    return [m for m in marks if m is not None]


def test_a_mark_per_20_ms_frame_and_played_follows_echoes() -> None:
    tracker = PlaybackTracker()
    tracker.start_response()
    marks = send_frames(tracker, 5)
    assert marks == ["vs1", "vs2", "vs3", "vs4", "vs5"]
    assert (tracker.sent_ms, tracker.played_ms, tracker.queued_ms, tracker.num_pending_marks) == (100.0, 0.0, 100.0, 5)
    assert tracker.on_mark("vs1") and tracker.on_mark("vs2")
    assert (tracker.played_ms, tracker.queued_ms, tracker.audio_end_ms) == (40.0, 60.0, 40.0)
    for name in marks[2:]:
        assert tracker.on_mark(name)
    assert (tracker.played_ms, tracker.queued_ms, tracker.num_pending_marks, tracker.audio_end_ms) == (100, 0, 0, 100)


def test_mark_interval_groups_frames_and_mark_now_covers_the_short_tail() -> None:
    tracker = PlaybackTracker(mark_interval_ms=100, mark_prefix="m")
    assert send_frames(tracker, 4) == []
    assert tracker.on_media_sent(NUM_FRAME_SAMPLES) == "m1"  # 100 ms since the start
    assert send_frames(tracker, 2) == [] and tracker.on_media_sent(40) is None  # a 5 ms short last frame
    assert tracker.mark_now() == "m2" and tracker.mark_now() is None
    assert tracker.on_mark("m2")
    assert tracker.played_ms == tracker.sent_ms == 145.0


def test_unknown_duplicate_and_out_of_order_marks_never_move_played_back_or_forward_wrongly() -> None:
    tracker = PlaybackTracker()
    marks = send_frames(tracker, 3)
    assert not tracker.on_mark("not-ours") and not tracker.on_mark("") and tracker.num_unknown_marks == 2
    assert tracker.on_mark(marks[1]) and tracker.played_ms == 40.0
    assert not tracker.on_mark(marks[1])  # a duplicate echo is unknown now
    assert not tracker.on_mark(marks[0]) and tracker.played_ms == 40.0  # late, earlier: never backwards
    assert tracker.num_unknown_marks == 3 and tracker.num_pending_marks == 1


def test_clear_mid_response_freezes_what_was_heard() -> None:
    tracker = PlaybackTracker()
    tracker.start_response()
    marks = send_frames(tracker, 10)  # 200 ms sent
    for name in marks[:3]:
        tracker.on_mark(name)  # 60 ms confirmed
    assert tracker.on_clear() == 60.0
    assert (tracker.played_ms, tracker.dropped_ms, tracker.queued_ms, tracker.sent_ms) == (60.0, 140.0, 0.0, 200.0)
    # NOTE: Twilio echoes every pending mark on clear; none of them may count as played.
    for name in marks[3:]:
        assert not tracker.on_mark(name)
    assert tracker.num_cleared_marks == 7 and tracker.num_pending_marks == 0
    assert tracker.played_ms == 60.0 and tracker.audio_end_ms == 60.0


def test_marks_echoed_after_the_clear_but_played_before_it_count_as_unplayed() -> None:
    """The conservative side: an echo in flight at the clear cannot be told from a cleared one."""
    tracker = PlaybackTracker()
    tracker.start_response()
    marks = send_frames(tracker, 4)
    tracker.on_mark(marks[0])
    tracker.on_clear()
    assert not tracker.on_mark(marks[1])  # really played (echo was in flight) -- written off anyway
    assert tracker.audio_end_ms == 20.0  # true value 40 ms: the error is one mark interval


def test_next_response_after_a_clear_continues_from_played() -> None:
    tracker = PlaybackTracker()
    tracker.start_response()
    first = send_frames(tracker, 5)
    tracker.on_mark(first[1])
    assert tracker.on_clear() == 40.0
    tracker.start_response()
    assert tracker.response_start_ms == 40.0 and tracker.audio_end_ms == 0.0
    second = send_frames(tracker, 3)
    assert second == ["vs6", "vs7", "vs8"]
    late = first[2:]
    assert not any(tracker.on_mark(name) for name in late)  # cleared echoes trickling in late
    assert tracker.on_mark(second[0]) and tracker.audio_end_ms == 20.0 and tracker.played_ms == 60.0
    assert tracker.on_mark(second[2]) and tracker.audio_end_ms == 60.0
    assert (tracker.sent_ms, tracker.dropped_ms, tracker.played_ms, tracker.queued_ms) == (160.0, 60.0, 100.0, 0.0)


def test_clear_with_nothing_sent_and_double_clear_are_harmless() -> None:
    tracker = PlaybackTracker()
    assert tracker.on_clear() == 0.0 and tracker.audio_end_ms == 0.0 and tracker.response_start_ms is None
    tracker.start_response()
    send_frames(tracker, 2)
    assert tracker.on_clear() == 0.0 and tracker.on_clear() == 0.0
    assert tracker.dropped_ms == 40.0 and tracker.mark_now() is None


def test_response_audio_queued_behind_the_previous_response() -> None:
    tracker = PlaybackTracker()
    tracker.start_response()
    first = send_frames(tracker, 3)
    tracker.start_response()  # the previous response's audio is still queued
    second = send_frames(tracker, 2)
    assert tracker.response_start_ms == 60.0
    tracker.on_mark(first[2])
    assert tracker.audio_end_ms == 0.0
    tracker.on_mark(second[0])
    assert tracker.audio_end_ms == 20.0
    # NOTE: a clear once the response is fully played drops nothing and keeps the whole response.
    tracker.on_mark(second[1])
    assert tracker.on_clear() == 40.0 and tracker.dropped_ms == 0.0


def test_clear_before_a_queued_response_played_at_all() -> None:
    tracker = PlaybackTracker()
    tracker.start_response()
    first = send_frames(tracker, 3)
    tracker.on_mark(first[0])
    tracker.start_response()  # starts at 60 ms, behind 40 ms of unplayed audio
    send_frames(tracker, 2)
    assert tracker.on_clear() == 0.0
    # NOTE: the timeline rewinds to played (20 ms): the unheard response is pulled back to start there.
    assert tracker.response_start_ms == 20.0 and tracker.audio_end_ms == 0.0 and tracker.dropped_ms == 80.0
    send_frames(tracker, 1)
    assert tracker.audio_end_ms == 0.0  # frozen: new audio belongs to the next start_response


def test_pending_marks_are_bounded_and_eviction_is_conservative() -> None:
    tracker = PlaybackTracker(max_pending_marks=3)
    marks = send_frames(tracker, 5)
    assert tracker.num_pending_marks == 3
    assert not tracker.on_mark(marks[0]) and tracker.played_ms == 0.0  # evicted: ignored
    assert tracker.on_mark(marks[3]) and tracker.played_ms == 80.0


def test_random_scripts_keep_the_invariants() -> None:
    rng = random.Random(1234)
    for _ in range(200):
        tracker = PlaybackTracker(mark_interval_ms=rng.choice([10, 20, 60]))
        pending: list[str] = []
        num_max_played = 0  # the highest played position seen, in samples
        for _ in range(60):
            action = rng.random()
            if action < 0.5:
                name = tracker.on_media_sent(rng.choice([160, 160, 80, 1]))
                pending += [name] if name else []
            elif action < 0.8 and pending:
                tracker.on_mark(pending.pop(0))  # an in-order echo
            elif action < 0.85:
                tracker.on_clear()
                pending.clear()
            elif action < 0.9:
                tracker.start_response()
            assert round(tracker.played_ms * 8) >= num_max_played  # never backwards
            num_max_played = round(tracker.played_ms * 8)
            assert 0 <= tracker.played_ms <= tracker.sent_ms - tracker.dropped_ms
            assert tracker.queued_ms >= 0 and tracker.audio_end_ms >= 0
            if tracker.response_start_ms is not None:
                assert tracker.audio_end_ms <= tracker.sent_ms - tracker.dropped_ms - tracker.response_start_ms


@pytest.mark.parametrize(
    "kwargs",
    [{"mark_interval_ms": 0}, {"mark_interval_ms": -1}, {"mark_interval_ms": True}, {"mark_interval_ms": float("nan")},
     {"max_pending_marks": 0}, {"max_pending_marks": 1.5}, {"mark_prefix": ""}],
)
def test_bad_configuration_is_refused(kwargs: dict[str, object]) -> None:
    with pytest.raises(ValueError):
        PlaybackTracker(**kwargs)  # type: ignore[arg-type]


def test_on_media_sent_refuses_bad_counts() -> None:
    tracker = PlaybackTracker()
    for bad in (-1, 1.0, True):
        with pytest.raises(ValueError, match="num_samples"):
            tracker.on_media_sent(bad)  # type: ignore[arg-type]
    assert tracker.on_media_sent(0) is None and tracker.sent_ms == 0.0
