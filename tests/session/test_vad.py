"""TurnDetector on real webrtcvad: turn times, gaps, clicks, padding, chunking, rates, reset, validation.

Signals: a synthetic voice (a 140 Hz glottal pulse train with vibrato through three formant resonators,
F1-F3 of an /a/) that webrtcvad flags as speech from its first frame to its last, between stretches of
-60 dBFS white noise that it flags as non-speech once its noise model has settled (it calls the first
~100 ms of a stream speech, so every signal opens with >= 500 ms of noise). Segment boundaries fall on
20 ms frames, so expected times follow from the segment lengths: start = onset - prefix padding,
stop = end of speech + silence_duration_ms, each within a frame.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import webrtcvad
from speech_signals import signal_of

from voice_server.audio import float32_to_pcm16
from voice_server.session import SpeechStarted, TurnDetectionConfig, TurnDetector, TurnEvent
from voice_server.session.vad import FRAME_MS, HANGOVER_FRAMES, INPUT_RATES, MAX_BLIP_FRAMES, start_ratio, vad_mode

FRAME_TOLERANCE_MS = FRAME_MS
DEFAULT = TurnDetectionConfig()


def _run(detector: TurnDetector, signal: np.ndarray, chunk_sizes: list[int] | None = None) -> list[TurnEvent]:
    events: list[TurnEvent] = []
    start = 0
    for size in chunk_sizes or [len(signal)]:
        events += detector.feed(signal[start : start + size])
        start += size
    if start < len(signal):
        events += detector.feed(signal[start:])
    return events


def _times(events: list[TurnEvent]) -> list[tuple[str, int]]:
    return [
        ("start", event.audio_start_ms) if isinstance(event, SpeechStarted) else ("stop", event.audio_end_ms)
        for event in events
    ]


def _assert_times(events: list[TurnEvent], expected: list[tuple[str, int]], tolerance_ms: int) -> None:
    got = _times(events)
    assert [kind for kind, _ in got] == [kind for kind, _ in expected], got
    for (_, got_ms), (_, want_ms) in zip(got, expected):
        assert abs(got_ms - want_ms) <= tolerance_ms, (got, expected)


def test_synthetic_voice_is_speech_and_noise_is_not() -> None:
    vad = webrtcvad.Vad(2)
    pcm = float32_to_pcm16(signal_of(16000, ("noise", 1000), ("voice", 400), ("noise", 1000)))
    flags = [vad.is_speech(pcm[i : i + 320].tobytes(), 16000) for i in range(0, len(pcm), 320)]
    assert not any(flags[10:50]) and all(flags[50:70]) and not any(flags[80:])


@pytest.mark.parametrize("mode", range(4))
def test_hangover_table_matches_webrtcvad(mode: int) -> None:
    """The frames webrtcvad adds after a blip and after long speech (the rules subtract them)."""
    short, long = HANGOVER_FRAMES[mode]
    for num_speech_frames, expected in ((2, short), (MAX_BLIP_FRAMES, short), (MAX_BLIP_FRAMES + 1, long), (30, long)):
        vad = webrtcvad.Vad(mode)
        pcm = float32_to_pcm16(signal_of(16000, ("noise", 1000), ("voice", 20 * num_speech_frames), ("noise", 1000)))
        flags = [vad.is_speech(pcm[i : i + 320].tobytes(), 16000) for i in range(0, len(pcm), 320)][50:]
        assert sum(flags) == num_speech_frames + expected and all(flags[: sum(flags)]), num_speech_frames


def test_threshold_mapping_and_default_rules() -> None:
    assert [vad_mode(t) for t in (0.0, 0.24, 0.25, 0.5, 0.74, 0.75, 1.0)] == [0, 0, 1, 2, 2, 3, 3]
    assert start_ratio(0.0) == pytest.approx(0.6) and start_ratio(1.0) == pytest.approx(1.0)
    detector = TurnDetector(DEFAULT, 16000)
    # 120 ms of speech + 4 frames of hangover; 13 frames = 10 / 0.8; 25 frames of silence - 6 of hangover.
    assert (detector.vad_mode, detector.num_start_frames, detector.num_start_window, detector.num_stop_frames) == (
        2,
        10,
        13,
        19,
    )


def test_speech_then_silence_gives_one_turn_at_the_right_times() -> None:
    signal = signal_of(16000, ("noise", 600), ("voice", 800), ("noise", 1000))
    detector = TurnDetector(DEFAULT, 16000)
    emitted_at: list[tuple[TurnEvent, int]] = []
    for start in range(0, len(signal), 320):  # 20 ms chunks: when each event comes out
        emitted_at += [(event, (start + 320) // 16) for event in detector.feed(signal[start : start + 320])]
        assert detector.is_speaking == (600 + 200 <= (start + 320) // 16 < 1900)
    events = [event for event, _ in emitted_at]
    _assert_times(events, [("start", 600 - 300), ("stop", 1400 + 500)], FRAME_TOLERANCE_MS)
    # Latency: the start after min_speech_ms + the short hangover (200 ms), the stop at audio_end_ms.
    assert emitted_at[0][1] == 600 + 200
    assert emitted_at[1][1] == events[1].audio_end_ms  # type: ignore[union-attr]
    assert not detector.is_speaking and detector.turn_start_ms is None


def test_resampled_input_is_late_only_by_the_filter_delay() -> None:
    """24 kHz: the times are those of 16 kHz; the events come out at most delay_in (60) input samples later."""
    signal = signal_of(24000, ("noise", 600), ("voice", 800), ("noise", 1000))
    detector = TurnDetector(DEFAULT, 24000)
    emitted_at = [(event, end) for end in range(1, len(signal) + 1) for event in detector.feed(signal[end - 1 : end])]
    _assert_times([event for event, _ in emitted_at], [("start", 300), ("stop", 1900)], FRAME_TOLERANCE_MS)
    # NOTE: a frame's last 16 kHz output reads input up to ~delay_in (60) samples past the frame's end.
    assert 24 * 800 < emitted_at[0][1] <= 24 * 800 + 60
    stop_end = 24 * emitted_at[1][0].audio_end_ms  # type: ignore[union-attr]
    assert stop_end < emitted_at[1][1] <= stop_end + 60


def test_a_gap_shorter_than_the_silence_window_does_not_end_the_turn() -> None:
    signal = signal_of(16000, ("noise", 600), ("voice", 600), ("noise", 400), ("voice", 600), ("noise", 1000))
    events = _run(TurnDetector(DEFAULT, 16000), signal)
    _assert_times(events, [("start", 300), ("stop", 2200 + 500)], FRAME_TOLERANCE_MS)
    # The same gap ends the turn once the window is shorter than it.
    events = _run(TurnDetector(TurnDetectionConfig(silence_duration_ms=300), 16000), signal)
    # NOTE: the second start (1600 - 300) is clamped at the first turn's end: turns never overlap.
    _assert_times(events, [("start", 300), ("stop", 1500), ("start", 1500), ("stop", 2500)], FRAME_TOLERANCE_MS)


def test_a_click_does_not_start_a_turn_but_min_speech_does() -> None:
    for num_click_ms in (20, 40, 60):
        signal = signal_of(16000, ("noise", 600), ("voice", num_click_ms), ("noise", 1000))
        assert _run(TurnDetector(DEFAULT, 16000), signal) == [], num_click_ms
    signal = signal_of(16000, ("noise", 600), ("voice", DEFAULT.start_speech_ms), ("noise", 1000))
    _assert_times(_run(TurnDetector(DEFAULT, 16000), signal), [("start", 300), ("stop", 1220)], FRAME_TOLERANCE_MS)
    # A longer minimum counts webrtcvad's longer hangover: 180 ms of speech is refused, 200 ms is a turn.
    config = TurnDetectionConfig(min_speech_ms=200)
    for num_speech_ms, num_events in ((180, 0), (200, 2)):
        signal = signal_of(16000, ("noise", 600), ("voice", num_speech_ms), ("noise", 1000))
        assert len(_run(TurnDetector(config, 16000), signal)) == num_events, num_speech_ms
    # Without a minimum, the 40 ms click does start a turn: the rule above is what rejected it. (So does
    # webrtcvad's first ~100 ms, before its noise model settles: another reason for the default.)
    config = TurnDetectionConfig(min_speech_ms=0, prefix_padding_ms=0)
    signal = signal_of(16000, ("noise", 600), ("voice", 40), ("noise", 1000))
    assert _times(_run(TurnDetector(config, 16000), signal))[-2:] == [("start", 600), ("stop", 1100)]


@pytest.mark.parametrize(("prefix_padding_ms", "expected_start_ms"), [(0, 600), (300, 300), (580, 20), (1000, 0)])
def test_prefix_padding_moves_the_start_earlier(prefix_padding_ms: int, expected_start_ms: int) -> None:
    signal = signal_of(16000, ("noise", 600), ("voice", 400), ("noise", 800))
    events = _run(TurnDetector(TurnDetectionConfig(prefix_padding_ms=prefix_padding_ms), 16000), signal)
    assert _times(events)[0] == ("start", expected_start_ms)


def test_prefix_padding_stops_at_the_previous_turn() -> None:
    signal = signal_of(16000, ("noise", 600), ("voice", 400), ("noise", 700), ("voice", 400), ("noise", 800))
    events = _run(TurnDetector(TurnDetectionConfig(prefix_padding_ms=1000), 16000), signal)
    assert _times(events) == [("start", 0), ("stop", 1500), ("start", 1500), ("stop", 2600)]


@pytest.mark.parametrize("rate", [16000, 24000])  # classified as is / through the resampler
def test_any_chunking_gives_the_same_events(rate: int) -> None:
    signal = signal_of(rate, ("noise", 500), ("voice", 300), ("noise", 200), ("voice", 200), ("noise", 560))
    whole = _run(TurnDetector(DEFAULT, rate), signal)
    assert len(whole) == 2
    rng = np.random.default_rng(rate)
    chunkings = {
        "1 sample": [1] * len(signal),
        "7 ms": [rate * 7 // 1000] * len(signal),
        "20 ms": [rate // 50] * len(signal),
        "333 ms": [rate * 333 // 1000] * len(signal),
        "random": list(rng.integers(0, 2000, size=len(signal))),
    }
    for name, sizes in chunkings.items():
        assert _run(TurnDetector(DEFAULT, rate), signal, sizes) == whole, name


def test_all_input_rates_and_dtypes_give_the_same_times() -> None:
    segments = (("noise", 600), ("voice", 500), ("noise", 300), ("voice", 300), ("noise", 900))
    expected = [("start", 300), ("stop", 1700 + 500)]
    for rate in INPUT_RATES:
        signal = signal_of(rate, *segments)
        _assert_times(_run(TurnDetector(DEFAULT, rate), signal), expected, FRAME_TOLERANCE_MS)
        as_int16 = _run(TurnDetector(DEFAULT, rate), float32_to_pcm16(signal))
        _assert_times(as_int16, expected, FRAME_TOLERANCE_MS)


def test_reset_forgets_the_turn_but_keeps_the_timeline() -> None:
    signal = signal_of(16000, ("noise", 600), ("voice", 1000), ("noise", 1000))
    detector = TurnDetector(DEFAULT, 16000)
    assert _times(detector.feed(signal[: 16 * 1000])) == [("start", 300)]
    assert detector.is_speaking and detector.turn_start_ms == 300
    detector.reset()
    assert not detector.is_speaking and detector.turn_start_ms is None
    # The speech goes on: a new turn, never before the reset (so the padding is cut there).
    events = detector.feed(signal[16 * 1000 :])
    _assert_times(events, [("start", 1000), ("stop", 1600 + 500)], 0)
    # A reset in silence changes nothing that follows.
    detector.reset()
    assert detector.feed(np.zeros(16000, dtype=np.float32)) == []


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"threshold": 2}, r"turn_detection\.threshold: must be in \[0, 1\], got 2"),
        ({"threshold": "high"}, r"turn_detection\.threshold: must be a number"),
        ({"threshold": float("nan")}, r"turn_detection\.threshold"),
        ({"prefix_padding_ms": -1}, r"turn_detection\.prefix_padding_ms: must be in \[0, 5000\] ms, got -1"),
        ({"silence_duration_ms": 2.5}, r"turn_detection\.silence_duration_ms: must be an integer"),
        ({"silence_duration_ms": True}, r"turn_detection\.silence_duration_ms"),
        ({"min_speech_ms": 5000}, r"turn_detection\.min_speech_ms"),
        ({"create_response": 1}, r"turn_detection\.create_response: must be true or false"),
        ({"interrupt_response": "yes"}, r"turn_detection\.interrupt_response"),
        ({"idle_timeout_ms": 0}, r"turn_detection\.idle_timeout_ms"),
    ],
)
def test_bad_config_fields_are_refused_by_name(fields: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        TurnDetectionConfig(**fields)  # type: ignore[arg-type]


def test_from_openai() -> None:
    config = TurnDetectionConfig.from_openai(
        {
            "type": "server_vad",
            "threshold": 1,
            "prefix_padding_ms": 200,
            "silence_duration_ms": 700,
            "create_response": False,
            "interrupt_response": False,
            "idle_timeout_ms": 6000,
        },
        min_speech_ms=80,
    )
    assert config == TurnDetectionConfig(1.0, 200, 700, 80, False, False, 6000)
    assert TurnDetectionConfig.from_openai({"type": "server_vad"}) == DEFAULT
    assert TurnDetectionConfig.from_openai({"type": "server_vad", "idle_timeout_ms": None}) == DEFAULT
    with pytest.raises(ValueError, match=r"turn_detection\.type: must be one of 'server_vad', 'semantic_vad', got 'x'"):
        TurnDetectionConfig.from_openai({"type": "x"})
    with pytest.raises(ValueError, match=r"turn_detection\.type"):
        TurnDetectionConfig.from_openai({"threshold": 0.5})
    with pytest.raises(ValueError, match=r"unknown key\(s\) 'silence_duration'"):
        TurnDetectionConfig.from_openai({"type": "server_vad", "silence_duration": 500})
    with pytest.raises(ValueError, match=r"turn_detection\.threshold"):
        TurnDetectionConfig.from_openai({"type": "server_vad", "threshold": -0.1})


@pytest.mark.parametrize(
    "samples",
    [
        np.zeros(320, dtype=np.float64),
        np.zeros(320, dtype=np.int32),
        np.zeros((2, 160), dtype=np.float32),
        [0.0] * 320,
    ],
)
def test_feed_refuses_anything_but_1d_float32_or_int16(samples: object) -> None:
    with pytest.raises(ValueError, match="samples must be a 1-D float32 or int16"):
        TurnDetector(DEFAULT, 16000).feed(samples)  # type: ignore[arg-type]


@pytest.mark.parametrize("rate", [16000, 24000])
def test_feed_refuses_non_finite_samples(rate: int) -> None:
    samples = np.zeros(480, dtype=np.float32)
    samples[7] = np.nan
    with pytest.raises(ValueError, match="samples holds .*non-finite"):
        TurnDetector(DEFAULT, rate).feed(samples)


@pytest.mark.parametrize("rate", [44100, 32000, 16000.0, True])
def test_unsupported_input_rates_are_refused(rate: object) -> None:
    with pytest.raises(ValueError, match="input_rate must be one of"):
        TurnDetector(DEFAULT, rate)  # type: ignore[arg-type]


def test_the_session_layer_does_not_import_torch() -> None:
    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")])}
    code = "import sys, voice_server.session; assert 'torch' not in sys.modules, 'torch imported'"
    subprocess.run([sys.executable, "-c", code], check=True, cwd=root, env=env)
