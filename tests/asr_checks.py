"""Shared pieces of the asr runner's tests for its engines (pocketsphinx: tests/runners/test_asr_runner.py;
Whisper: test_asr_whisper_runner.py): a runner over a recogniser pool, stepped one batch at a time as the
stage shell steps it."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from voice_server.runners.asr_runner import AsrRunner, AsrRunnerConfig
from voice_server.scheduling import Emit, SimpleBatch, WorkItem

HISTORY = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "hi"},
           {"role": "assistant", "content": "Hello."}]
MAX_WER = 0.35


def runner_over(pool: Any) -> Iterator[AsrRunner]:
    """The body of a runner fixture: every recogniser is back in the pool afterwards."""
    runner = AsrRunner(pool, AsrRunnerConfig(max_audio_seconds=10.0))
    yield runner
    for request_id in list(runner._requests):  # NOTE: a failed test must not keep recognisers from the next
        runner.release(request_id)
    assert pool.num_free == pool.num_decoders


def run(runner: AsrRunner, items: list[WorkItem]) -> list[Emit]:
    """Admit then execute `items` as one batch; release the requests that left (as the shell does)."""
    emits = list(runner.execute(SimpleBatch(tuple(runner.admit(i) for i in items))).emits)
    for emit in emits:
        if emit.is_final:
            runner.release(emit.request_id)
    return emits
