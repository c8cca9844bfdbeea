"""The text-to-speech runner in-process, over the real hibari-tts engine: streamed text speaks each
clause as soon as it completes, whole text speaks the same audio, bad input is refused alone, and
the factory checks its args and never takes hibari's downloading path."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from typing import Any

import hibari.tts
import hibari.voices
import numpy as np
import pytest
from speech_text import transcribe, word_error_rate
from talker_checks import emitted_pcm, run, stage_ctx, stream_items

from voice_server.config.errors import ConfigError
from voice_server.runners.clauses import ClauseRules
from voice_server.runners.synthesizers import HIBARI_RATE as SAMPLE_RATE
from voice_server.runners.tts_runner import TTSRunner, TTSRunnerConfig
from voice_server.scheduling import AdmissionError, Emit, EmitKind, SimpleBatch, WorkItem, WorkKind
from voice_server.stages.tts import create_tts

TEXT = "Hello there, how are you today? I hope the weather is nice where you are."
DELTAS = ["Hello", " there", ",", " how", " are", " you", " today", "?", " I", " hope", " the", " weather", " is",
          " nice", " where", " you", " are", "."]


@pytest.fixture(scope="module")
def runner() -> Iterator[TTSRunner]:
    with pytest.MonkeyPatch.context() as patch:
        def no_download(*args: Any, **kwargs: Any) -> None:
            raise AssertionError("the stage reached hibari's voice download path")

        # NOTE: hibari downloads a missing voice in `voice_path`; the stage must never go there.
        patch.setattr(hibari.tts, "voice_path", no_download)
        patch.setattr(hibari.voices, "download", no_download)
        yield create_tts(stage_ctx())


def test_a_clause_is_spoken_as_soon_as_the_text_completing_it_arrives(runner: TTSRunner) -> None:
    items = stream_items("a", DELTAS)
    admitted = [runner.admit(item) for item in items]
    per_item = [runner.execute(SimpleBatch((item,))).emits for item in admitted]
    first_audio = next(i for i, emits in enumerate(per_item) if emits)
    # NOTE: "Hello there," is complete once " how" (item 4: NEW, then chunks 0..3) shows the comma ends it.
    assert first_audio == 4 and [e.kind for e in per_item[4]] == [EmitKind.STREAM]
    assert any(e.kind is EmitKind.STREAM for e in per_item[9])  # " I" completes "how are you today?"
    final = per_item[-1]
    assert [e.kind for e in final] == [EmitKind.STREAM, EmitKind.RESULT]  # the rest, flushed at DONE
    emits = [e for emits in per_item for e in emits]
    assert final[-1].payload == {"num_samples": pcm_of(emits).size, "num_clauses": 3}
    assert not any("text" in e.payload for e in emits)
    runner.release("a")


def test_whole_text_gives_the_same_audio_as_its_deltas(runner: TTSRunner) -> None:
    streamed = run(runner, *stream_items("s", DELTAS))
    whole = run(runner, WorkItem("w", WorkKind.NEW, {"text": TEXT}))
    assert [e.kind for e in whole] == [EmitKind.STREAM] * 3 + [EmitKind.RESULT]
    assert np.array_equal(pcm_of(whole), pcm_of(streamed))
    pcm = pcm_of(whole)
    assert 2.0 < pcm.size / SAMPLE_RATE < 10.0 and 0.05 < float(np.abs(pcm).max()) <= 1.5
    assert word_error_rate(TEXT, transcribe(pcm, SAMPLE_RATE)) <= 0.35
    for rid in ("s", "w"):
        runner.release(rid)


def test_requests_interleaved_in_one_batch_each_get_their_own_audio(runner: TTSRunner) -> None:
    solo = {rid: pcm_of(run(runner, *stream_items(rid, deltas)))
            for rid, deltas in (("x", DELTAS), ("y", ["Good", " morning", ",", " dear", " friend", "."]))}
    streams = [stream_items("x2", DELTAS), stream_items("y2", ["Good", " morning", ",", " dear", " friend", "."])]
    mixed = [item for pair in zip(*streams) for item in pair] + streams[0][len(streams[1]):]
    emits = runner.execute(SimpleBatch(tuple(runner.admit(item) for item in mixed))).emits
    for rid in ("x", "y"):
        assert np.array_equal(pcm_of([e for e in emits if e.request_id == rid + "2"]), solo[rid])
        assert [e.kind for e in emits if e.request_id == rid + "2"][-1] is EmitKind.RESULT
    for rid in ("x", "y", "x2", "y2"):
        runner.release(rid)


def test_nothing_speakable_ends_with_an_empty_result(runner: TTSRunner) -> None:
    emits = run(runner, *stream_items("e", ["", "😀", " https://example.com", ""]))
    assert [(e.kind, e.payload) for e in emits] == [(EmitKind.RESULT, {"num_samples": 0, "num_clauses": 0})]
    runner.release("e")


@pytest.mark.parametrize(("item", "needle"), [
    (WorkItem("b", WorkKind.NEW, {"text": 42}), "payload.text: must be a string"),
    (WorkItem("b", WorkKind.NEW, {"prompt": "hi"}), "payload.text: missing"),
    (WorkItem("b", WorkKind.NEW, ["text"]), "payload: must be a mapping"),  # type: ignore[arg-type]
    (WorkItem("b", WorkKind.CHUNK, {"text": "hi"}), "before the request opened"),
])
def test_malformed_input_is_refused_naming_the_field(runner: TTSRunner, item: WorkItem, needle: str) -> None:
    with pytest.raises(AdmissionError, match=needle):
        runner.admit(item)
    runner.release("b")


def test_a_refused_chunk_fails_its_request_and_others_keep_speaking(runner: TTSRunner) -> None:
    runner.admit(WorkItem("bad", WorkKind.NEW, is_stream=True))
    for payload in ({"token_ids": [1]}, {"text": None}):
        with pytest.raises(AdmissionError, match="chunk payload.text"):
            runner.admit(WorkItem("bad", WorkKind.CHUNK, payload))
    runner.release("bad")
    assert pcm_of(run(runner, WorkItem("ok", WorkKind.NEW, {"text": "Still here."}))).size > 0
    runner.release("ok")


def test_text_beyond_max_text_chars_is_refused(runner: TTSRunner) -> None:
    small = TTSRunner(runner.engine, TTSRunnerConfig(max_text_chars=20))
    with pytest.raises(AdmissionError, match="max_text_chars"):
        small.admit(WorkItem("long", WorkKind.NEW, {"text": "x" * 21}))
    small.admit(WorkItem("grow", WorkKind.NEW, is_stream=True))
    small.admit(WorkItem("grow", WorkKind.CHUNK, {"text": "y" * 20}))
    with pytest.raises(AdmissionError, match="exceeds 20 characters"):
        small.admit(WorkItem("grow", WorkKind.CHUNK, {"text": "z"}))


def test_release_forgets_the_request(runner: TTSRunner) -> None:
    items = stream_items("r", DELTAS)
    run(runner, *items[:3])
    runner.release("r")
    assert runner.execute(SimpleBatch((items[-1],))).emits == ()


@pytest.mark.parametrize(("args", "field"), [
    ({"voice": "emma"}, "factory_args.voice"),
    ({"engine": "espeak"}, "factory_args.engine"),
    ({"engine": ["piper"]}, "factory_args.engine"),
    ({"num_threads": 0}, "factory_args.num_threads"),
    ({"speed": 3.0}, "factory_args.speed"),
    ({"speed": "fast"}, "factory_args.speed"),
    ({"seed": -1}, "factory_args.seed"),
    ({"min_clause_chars": 50, "max_clause_chars": 40}, "factory_args.max_clause_chars"),
    ({"max_text_chars": True}, "factory_args.max_text_chars"),
])
def test_factory_args_are_checked_naming_the_field(args: dict[str, Any], field: str) -> None:
    with pytest.raises(ConfigError, match=f"stage 'talker': field '{field}'"):
        create_tts(stage_ctx(**args))


def test_startup_reports_its_phases() -> None:
    phases: list[str] = []
    create_tts(stage_ctx(phases=phases, num_threads=2))
    assert phases == ["loading hibari-tts (voice heart, 2 thread(s))", "warming up"]


def test_factory_refuses_a_gpu_device() -> None:
    with pytest.raises(ConfigError, match="field 'device': hibari-tts runs on the CPU"):
        create_tts(stage_ctx(device="cuda"))


def test_a_missing_package_fails_startup_saying_what_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "hibari", None)  # NOTE: makes `import hibari` raise ImportError
    with pytest.raises(ConfigError, match="field 'factory': needs the hibari-tts package .*pip install 'hibari-tts"):
        create_tts(stage_ctx())


def test_runner_config_is_validated() -> None:
    for bad in ({"speed": 0.1}, {"seed": 1.5}, {"max_text_chars": 0}):
        with pytest.raises(ValueError, match="TTSRunnerConfig"):
            TTSRunnerConfig(**bad)  # type: ignore[arg-type]
    assert TTSRunnerConfig().clauses == ClauseRules()


def test_word_error_rate() -> None:
    assert word_error_rate("Hello, World!", "hello world") == 0.0
    assert word_error_rate("It's a well-known fact.", "it's a well known fact") == 0.0
    assert word_error_rate("one two three four", "one too three") == 0.5
    assert word_error_rate("one two", "one two three four") == 1.0
    assert word_error_rate("", "") == 0.0 and word_error_rate("", "noise") == 1.0


def pcm_of(emits: list[Emit]) -> np.ndarray:
    return emitted_pcm(emits, SAMPLE_RATE)
