"""SmartTurnModel and SileroVad on the real ONNX files of the installed pipecat-ai wheel, on speech
synthesised at test time (hibari-tts, seed 0, 24 kHz resampled to 16 kHz).

Reference features: pipecat's ``_whisper_features.py``, loaded from its file so that pipecat's package
``__init__`` (which needs loguru, pydantic, ...) never runs; the file itself imports numpy only.

Smart Turn judges prosody, not words: hibari speaks every text with a final, falling contour unless
the text tells it to go on, so "I would like to book a table for" scores as complete as a question
(~0.99). The incomplete utterances here end in ", and" (a rising, continuing contour, ~0.01-0.14).
"""

from __future__ import annotations

import functools
import importlib.util
from types import ModuleType
from typing import Any

import numpy as np
import numpy.typing as npt
import onnxruntime as ort
import pytest

from voice_server.audio import StreamResampler
from voice_server.session.turn_models import (
    SileroVad,
    SmartTurnModel,
    load_silero_session,
    pipecat_data_file,
    whisper_log_mel,
)

RATE = 16000
TTS_RATE = 24000
SPEECH_DBFS = -45.0  # a window louder than this in the clean signal is speech
MIN_MARGIN = 0.5
PAIRS = (  # (complete, incomplete)
    ("What is the capital of France?", "What is the capital of France, and"),
    ("Please turn off the lights in the kitchen.", "Please turn off the lights in the kitchen, and then"),
    ("Thank you, that is all I needed.", "My phone number is five five five, and"),
)


@functools.cache
def _tts() -> Any:
    from hibari import Hibari

    return Hibari()


@functools.cache
def _speech(text: str) -> npt.NDArray[np.float32]:
    resampler = StreamResampler(TTS_RATE, RATE)
    audio = _tts()(text, seed=0)
    out = np.concatenate([resampler.process(audio), resampler.flush()])[resampler.spec.delay_out:]
    out.setflags(write=False)  # NOTE: cached and shared between tests
    return out


@functools.cache
def _smart_turn() -> SmartTurnModel:
    return SmartTurnModel()


@functools.cache
def _pipecat_features() -> ModuleType:
    path = pipecat_data_file("audio/turn/smart_turn/_whisper_features.py")
    spec = importlib.util.spec_from_file_location("pipecat_whisper_features", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _pad_front(audio: npt.NDArray[np.float32], seconds: float) -> npt.NDArray[np.float32]:
    return np.concatenate([np.zeros(int(seconds * RATE) - len(audio), np.float32), audio])


# --- features ---


def test_log_mel_equals_pipecat_on_random_audio() -> None:
    audio = (np.random.default_rng(0).standard_normal(8 * RATE) * 0.1).astype(np.float32)
    ours, reference = whisper_log_mel(audio), _pipecat_features().compute_whisper_log_mel_features(audio)
    assert ours.shape == reference.shape == (80, 800)
    np.testing.assert_allclose(ours, reference, rtol=0, atol=1e-4)


def test_log_mel_equals_pipecat_on_sine_sweep_and_speech() -> None:
    freq = np.geomspace(30.0, 7900.0, 8 * RATE)
    sweep = (0.3 * np.sin(2 * np.pi * np.cumsum(freq) / RATE)).astype(np.float32)
    speech = _pad_front(_speech("What is the capital of France?"), 8)
    for audio in (sweep, speech):
        reference = _pipecat_features().compute_whisper_log_mel_features(audio, do_normalize=True)
        np.testing.assert_allclose(whisper_log_mel(audio), reference, rtol=0, atol=1e-4)


def test_features_keep_the_last_8s_zero_padded_in_front() -> None:
    audio = _speech("What is the capital of France?")
    features = _smart_turn().features(audio)
    assert features.shape == (1, 80, 800) and features.dtype == np.float32
    np.testing.assert_array_equal(features[0], whisper_log_mel(_pad_front(audio, 8)))


def test_missing_pipecat_file_names_the_fix() -> None:
    with pytest.raises(RuntimeError, match=r"no_such_model\.onnx.*pip install --no-deps pipecat-ai==1\.14\.0"):
        pipecat_data_file("audio/no_such_model.onnx")


# --- Smart Turn ---


@pytest.mark.parametrize(("complete", "incomplete"), PAIRS)
def test_smart_turn_scores_complete_above_incomplete(complete: str, incomplete: str) -> None:
    model = _smart_turn()
    p_complete, p_incomplete = model.predict(_speech(complete)), model.predict(_speech(incomplete))
    assert 0.0 <= p_incomplete <= 1.0 and 0.0 <= p_complete <= 1.0
    assert p_complete - p_incomplete >= MIN_MARGIN, (p_complete, p_incomplete)


def test_smart_turn_short_input() -> None:
    audio = _speech("Yes.")[: int(0.3 * RATE)].copy()
    assert 0.0 <= _smart_turn().predict(audio) <= 1.0
    assert 0.0 <= _smart_turn().predict(np.zeros(1, np.float32)) <= 1.0


def test_smart_turn_uses_only_the_last_8s() -> None:
    incomplete = _pad_front(_speech("What is the capital of France, and"), 8)
    complete = _pad_front(_speech("What is the capital of France?"), 4)
    audio = np.concatenate([incomplete, complete])  # 12 s: the first 8 s end mid-turn, the last 8 s complete
    model = _smart_turn()
    p_all, p_last = model.predict(audio), model.predict(audio[-8 * RATE:].copy())
    assert p_all == pytest.approx(p_last, abs=1e-6)
    assert p_all - model.predict(audio[: 8 * RATE].copy()) >= MIN_MARGIN


def test_smart_turn_rejects_empty_audio() -> None:
    with pytest.raises(ValueError, match="non-empty"):
        _smart_turn().predict(np.zeros(0, np.float32))


# --- Silero VAD ---


@functools.cache
def _silero_session() -> ort.InferenceSession:
    return load_silero_session()


def _vad(**kwargs: bool) -> SileroVad:
    return SileroVad(_silero_session(), **kwargs)


def _window_dbfs(audio: npt.NDArray[np.float32]) -> npt.NDArray[np.float64]:
    windows = audio[: len(audio) // SileroVad.WINDOW * SileroVad.WINDOW].reshape(-1, SileroVad.WINDOW)
    return 10 * np.log10(np.mean(windows.astype(np.float64) ** 2, axis=1) + 1e-20)


def test_silero_speech_windows_score_high() -> None:
    audio = _speech("Please tell me the weather in London tomorrow morning.")
    probs = np.array(_vad().feed(audio))
    assert len(probs) == len(audio) // SileroVad.WINDOW
    assert np.all((probs >= 0) & (probs <= 1))
    is_speech = _window_dbfs(audio) > SPEECH_DBFS
    assert is_speech.sum() >= 30
    assert np.mean(probs[is_speech] > 0.5) >= 0.9


def test_silero_silence_and_low_noise_score_low() -> None:
    silence = np.zeros(3 * RATE, np.float32)
    noise = (np.random.default_rng(1).standard_normal(3 * RATE) * 10 ** (-50 / 20)).astype(np.float32)
    for audio in (silence, noise):
        assert max(_vad().feed(audio)) < 0.5


def test_silero_chunking_does_not_change_probabilities() -> None:
    audio = _speech("What time does the train leave for New York City?")
    whole = _vad().feed(audio)
    vad, chunked, start = _vad(), [], 0
    for size in [1, 0, 511, 513, 100, 1024, 7, 2000] * 100:
        chunked += vad.feed(audio[start:start + size])
        start += size
        if start >= len(audio):
            break
    chunked += vad.feed(audio[start:])
    assert chunked == whole


def test_silero_streams_sharing_a_session_are_independent() -> None:
    speech = _speech("I would like to book a table for two people tonight.")
    noise = (np.random.default_rng(2).standard_normal(len(speech)) * 0.01).astype(np.float32)
    alone_a, alone_b = _vad().feed(speech), _vad().feed(noise)
    vad_a, vad_b = _vad(), _vad()
    assert vad_a.session is vad_b.session
    got_a: list[float] = []
    got_b: list[float] = []
    for start in range(0, len(speech), 700):
        got_a += vad_a.feed(speech[start:start + 700])
        got_b += vad_b.feed(noise[start:start + 700])
    assert got_a == alone_a and got_b == alone_b


def test_silero_reset_gives_a_fresh_stream() -> None:
    speech = _speech("How many legs does a spider have?")
    fresh = _vad().feed(speech)
    vad = _vad()
    vad.feed(_speech("Please tell me the weather in London tomorrow morning.")[:-300])  # leaves a partial window
    vad.reset()
    assert vad.feed(speech) == fresh


def test_silero_periodic_reset_after_clear_non_speech() -> None:
    # NOTE: 63 windows (>= 2 s) of digital silence: the state is reset after window 63, so the stream then
    # scores exactly as a fresh one; without periodic resets the state drifted in the silence.
    audio = np.concatenate([np.zeros(80 * SileroVad.WINDOW, np.float32), _speech("What is two plus two?")])
    fresh = _vad().feed(audio[63 * SileroVad.WINDOW:])
    assert _vad().feed(audio)[63:] == fresh
    assert _vad(is_periodic_reset=False).feed(audio)[63:] != fresh


def test_silero_skipped_windows_are_replayed_before_the_next_score() -> None:
    # NOTE: up to NUM_REPLAYED_WINDOWS skipped windows, the stream scores the speech after them exactly as
    # one that scored every window; skipping costs no model call until then, and scores 0.
    speech = _speech("How many legs does a spider have?")
    gap = (np.random.default_rng(3).standard_normal(SileroVad.NUM_REPLAYED_WINDOWS * SileroVad.WINDOW)
           * 10 ** (-70 / 20)).astype(np.float32)
    audio = np.concatenate([speech, gap, speech])
    scored = _vad().feed(audio)
    vad, got = _vad(), []
    num_first, num_gap = len(speech) // SileroVad.WINDOW, SileroVad.NUM_REPLAYED_WINDOWS
    for index, (window, _) in enumerate(vad.windows(audio)):
        is_gap = num_first < index <= num_first + num_gap - 1  # NOTE: the windows wholly inside the gap
        got.append(vad.skip(window) if is_gap else vad.score(window))
    assert all(p == 0.0 for p in got[num_first + 1:num_first + num_gap])
    assert got[num_first + num_gap:] == scored[num_first + num_gap:]


def test_silero_skipped_silence_counts_toward_the_periodic_reset() -> None:
    # NOTE: 80 skipped windows of silence reset the state (as 80 scored ones do, above), so speech after them
    # scores as in a fresh stream once the replayed windows are scored too: for the first 16 windows, before
    # which neither can reset again (the reset came at silence window 33, so 47 windows have been counted since).
    silence = np.zeros(80 * SileroVad.WINDOW, np.float32)
    speech = _speech("What is two plus two?")
    vad = _vad()
    vad.feed(_speech("Please tell me the weather in London tomorrow morning.")[:30 * SileroVad.WINDOW])
    for window, _ in vad.windows(silence):
        assert vad.skip(window) == 0.0
    fresh = _vad()
    fresh.feed(silence[-SileroVad.NUM_REPLAYED_WINDOWS * SileroVad.WINDOW:])
    assert vad.feed(speech)[:16] == fresh.feed(speech)[:16]
