"""No dead air from the talker: each sentence's leading and trailing silence is trimmed (never
anything at or above the level), clauses are joined with the configured pauses, and the trimmed
speech transcribes as the engine's own does. Rules on synthetic audio; the runner over real hibari-tts."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest
from speech_text import transcribe, word_error_rate
from talker_checks import run, stage_ctx

from voice_server.config.errors import ConfigError
from voice_server.runners.speech_edges import (
    EdgeRules,
    audible_span,
    frame_levels_db,
    join_sentences,
    pause_after,
    trim_edges,
)
from voice_server.runners.synthesizers import HIBARI_RATE as RATE
from voice_server.runners.tts_runner import TTSRunner
from voice_server.scheduling import EmitKind, WorkItem, WorkKind
from voice_server.stages.tts import create_tts

AUDIBLE_DB = -40.0
TEXTS = ("The capital of France is Paris. It is lovely, and quite big.",
         "Sure! Two plus two is four, of course.",
         "I would like to book a table for two people tonight, please.")


def tone(ms: int, db: float, rate: int = RATE) -> np.ndarray:
    t = np.arange(rate * ms // 1000) / rate
    return (10 ** (db / 20) * np.sqrt(2) * np.sin(2 * np.pi * 220 * t)).astype(np.float32)


def silence(ms: int, db: float | None = None, rate: int = RATE, seed: int = 0) -> np.ndarray:
    if db is None:
        return np.zeros(rate * ms // 1000, np.float32)
    return (10 ** (db / 20) * np.random.default_rng(seed).standard_normal(rate * ms // 1000)).astype(np.float32)


def audible_frames(pcm: np.ndarray, rate: int = RATE) -> np.ndarray:
    return np.flatnonzero(frame_levels_db(pcm, rate) >= AUDIBLE_DB)


def gaps_ms(pcm: np.ndarray, min_ms: int = 100) -> list[int]:
    """Runs of inaudible 10 ms frames between audible ones, at least `min_ms` long."""
    loud = audible_frames(pcm)
    steps = np.diff(loud) - 1
    return [int(s) * 10 for s in steps if s * 10 >= min_ms]


# -- the rules ---------------------------------------------------------------------------------------

def test_silence_around_a_sentence_is_cut_to_the_margin_and_faded() -> None:
    rules = EdgeRules()
    pcm = np.concatenate([silence(300, -70), tone(500, -12), silence(400, -70)])
    out = trim_edges(pcm, RATE, rules)
    margin = RATE * rules.margin_ms // 1000
    assert out.size == RATE * 500 // 1000 + 2 * margin
    assert out[0] == 0.0 and out[-1] == pytest.approx(0.0, abs=1e-3)  # NOTE: faded edges never click
    assert np.array_equal(out[margin:-margin], pcm[RATE * 300 // 1000: RATE * 800 // 1000])


@pytest.mark.parametrize("seed", range(8))
def test_nothing_at_or_above_the_level_is_ever_cut(seed: int) -> None:
    rng = np.random.default_rng(seed)
    rules = EdgeRules()
    parts, loud_spans, at = [silence(int(rng.integers(0, 400)), float(rng.uniform(-90, -50)), seed=seed)], [], 0
    for index in range(int(rng.integers(1, 4))):
        at += parts[-1].size
        parts.append(tone(int(rng.integers(20, 300)), float(rng.uniform(-44, -6))))
        loud_spans.append((at, at + parts[-1].size))
        at += parts[-1].size
        parts.append(silence(int(rng.integers(0, 300)), float(rng.uniform(-90, -50)), seed=seed + index))
    pcm = np.concatenate(parts)
    first, last = audible_span(pcm, RATE, rules)
    frame, margin = RATE // 100, RATE * rules.margin_ms // 1000
    assert first <= loud_spans[0][0] and last >= loud_spans[-1][1]  # NOTE: every tone is kept whole
    assert loud_spans[0][0] - first <= margin + frame and last - loud_spans[-1][1] <= margin + frame
    out = trim_edges(pcm, RATE, rules)
    assert np.array_equal(out[margin:-margin], pcm[first + margin:last - margin])


def test_a_sentence_quiet_throughout_is_dropped_and_trimming_can_be_turned_off() -> None:
    quiet = silence(500, -60)
    assert trim_edges(quiet, RATE, EdgeRules()).size == 0
    assert join_sentences([quiet, quiet], RATE, EdgeRules(), lead_ms=300).size == 0  # NOTE: no lead either
    pcm = np.concatenate([silence(300), tone(200, -12), silence(300)])
    assert np.array_equal(trim_edges(pcm, RATE, EdgeRules(is_trimmed=False)), pcm)
    assert np.array_equal(join_sentences([pcm, pcm], RATE, EdgeRules(is_trimmed=False), 300),
                          np.concatenate([pcm, pcm]))


def test_sentences_are_joined_with_the_sentence_pause_after_the_lead() -> None:
    rules = EdgeRules(margin_ms=0, sentence_pause_ms=250)
    a, b = tone(200, -12), tone(300, -12)
    out = join_sentences([np.concatenate([silence(300), a]), np.concatenate([b, silence(300)])], RATE, rules, 120)
    assert out.size == RATE * (120 + 200 + 250 + 300) // 1000
    assert not out[: RATE * 120 // 1000].any()


@pytest.mark.parametrize(("clause", "is_sentence_end"), [
    ("Hello there,", False), ("It is big.", True), ("Really?", True), ('He said "yes!"', True),
    ("Wait —", False), ("so then", None), ("Well…", True), ("one; two:", False)])
def test_a_sentence_end_gets_the_longer_pause(clause: str, is_sentence_end: bool | None) -> None:
    rules = EdgeRules(clause_pause_ms=120, sentence_pause_ms=320)
    # NOTE: None: no mark at all (a clause cut at a word): half the clause pause.
    assert pause_after(clause, rules) == {True: 320, False: 120, None: 60}[is_sentence_end]


@pytest.mark.parametrize(("kwargs", "needle"), [
    ({"level_db": -10}, "level_db"), ({"margin_ms": -1}, "margin_ms"), ({"clause_pause_ms": 2.5}, "clause_pause_ms"),
    ({"sentence_pause_ms": 5000}, "sentence_pause_ms"), ({"is_trimmed": 1}, "is_trimmed")])
def test_rules_are_validated(kwargs: dict[str, object], needle: str) -> None:
    with pytest.raises(ValueError, match=needle):
        EdgeRules(**kwargs)  # type: ignore[arg-type]


@pytest.mark.parametrize(("args", "field"), [
    ({"trim_silence": "yes"}, "factory_args.trim_silence"), ({"clause_pause_ms": -5}, "factory_args.clause_pause_ms"),
    ({"sentence_pause_ms": 9000}, "factory_args.sentence_pause_ms")])
def test_factory_args_are_checked_naming_the_field(args: dict[str, object], field: str) -> None:
    with pytest.raises(ConfigError, match=field):
        create_tts(stage_ctx(**args))


# -- the runner over hibari-tts -----------------------------------------------------------------------

@pytest.fixture(scope="module")
def runners() -> Iterator[tuple[TTSRunner, TTSRunner]]:
    yield create_tts(stage_ctx()), create_tts(stage_ctx(trim_silence=False))


def speak(runner: TTSRunner, text: str) -> list[np.ndarray]:
    emits = run(runner, WorkItem("r", WorkKind.NEW, {"text": text}))
    runner.release("r")
    return [e.payload["pcm"] for e in emits if e.kind is EmitKind.STREAM]


def test_a_reply_speaks_at_once_ends_with_its_speech_and_pauses_naturally(runners: tuple[TTSRunner, TTSRunner]) -> None:
    trimmed, raw = runners
    rules = trimmed.config.edges
    for text in TEXTS:
        chunks, raw_chunks = speak(trimmed, text), speak(raw, text)
        pcm, raw_pcm = np.concatenate(chunks), np.concatenate(raw_chunks)
        loud, raw_loud = audible_frames(pcm), audible_frames(raw_pcm)
        assert raw_loud[0] * 10 >= 200  # NOTE: the engine's own lead, which this removes
        assert loud[0] * 10 <= 40, f"{text!r}: first audible frame at {loud[0] * 10} ms"
        assert (len(frame_levels_db(pcm, RATE)) - 1 - loud[-1]) * 10 <= 100
        # NOTE: each join is the configured pause plus the decay and onset that lie below -40 dBFS.
        for gap in gaps_ms(pcm, min_ms=rules.clause_pause_ms):
            assert gap <= rules.sentence_pause_ms + 150, f"{text!r}: {gaps_ms(pcm)}"
        # NOTE: a join where no mark ends the clause (the first clause cut where a phrase starts) pauses half as long
        assert len(gaps_ms(pcm, rules.clause_pause_ms // 2)) >= len(chunks) - 1
        assert pcm.size < raw_pcm.size - RATE * 0.5 * len(chunks)


def test_trimmed_speech_transcribes_as_the_engines_own(runners: tuple[TTSRunner, TTSRunner]) -> None:
    trimmed, raw = runners
    pad = silence(300)  # NOTE: the recogniser needs a little silence before the first word, as a listener does not
    heard = {name: " ".join(transcribe(np.concatenate([pad, *speak(runner, text), pad]), RATE) for text in TEXTS)
             for name, runner in (("trimmed", trimmed), ("raw", raw))}
    text = " ".join(TEXTS)
    assert word_error_rate(text, heard["trimmed"]) <= word_error_rate(text, heard["raw"]) + 0.1, heard
    assert word_error_rate(heard["raw"], heard["trimmed"]) <= 0.15, heard
