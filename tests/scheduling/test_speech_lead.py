"""ARScheduler with `speech_lead_s`: replies far ahead of their listeners sit out steps while another is behind."""

from __future__ import annotations

import pytest
from scheduling.ar_fakes import FakeRunner, check_pages, new

from voice_server.config import StageConfig
from voice_server.config.errors import ConfigError
from voice_server.scheduling import SCHEDULER_BUILDERS, ARScheduler
from voice_server.scheduling.contract import ARSpec
from voice_server.scheduling.speech_lead import TOKENS_PER_SPEECH_S, SpeechLead


def make(speech_lead_s: float = 1.0, num_pages: int = 64) -> tuple[ARScheduler, FakeRunner]:
    spec = ARSpec(num_pages, 4, 256, ())
    return ARScheduler(spec, 8, 64, True, speech_lead_s), FakeRunner(spec)


def step(sched: ARScheduler, runner: FakeRunner, now: float) -> list[str]:
    """The request ids of one step at `now` (empty: nothing ran)."""
    batch = sched.schedule(now)
    check_pages(sched)
    if batch is None:
        return []
    sched.update(batch, runner.execute(batch))
    check_pages(sched)
    return [seq.request_id for seq in batch.seqs]


def test_a_reply_ahead_sits_out_until_the_new_one_is_ahead_too() -> None:
    sched, runner = make()
    sched.add(new("a", [1, 2, 3], max_tokens=100), 0.0)
    num_ahead = int(TOKENS_PER_SPEECH_S) + 2  # NOTE: over a second of speech at t=0
    for _ in range(num_ahead):
        assert step(sched, runner, 0.0) == ["a"]  # alone, ahead or not, it always steps
    sched.add(new("b", list(range(10, 20)), max_tokens=100), 0.0)
    steps = [step(sched, runner, 0.0) for _ in range(int(TOKENS_PER_SPEECH_S) + 1)]
    # NOTE: b's prefill (which samples its first token) and its decodes up to a second of speech, alone...
    assert steps[:int(TOKENS_PER_SPEECH_S)] == [["b"]] * int(TOKENS_PER_SPEECH_S)
    assert steps[-1] == ["a", "b"]  # ...then both are ahead: everyone steps again
    assert sched.stats()["num_lead_skips"] == int(TOKENS_PER_SPEECH_S)


def test_a_lead_runs_down_as_time_passes() -> None:
    sched, runner = make()
    sched.add(new("a", [1, 2, 3], max_tokens=100), 0.0)
    for _ in range(int(TOKENS_PER_SPEECH_S) + 2):  # a: 8 outputs at t=0, 1.33 s of speech
        step(sched, runner, 0.0)
    sched.add(new("b", list(range(10, 20)), max_tokens=100), 0.0)
    assert step(sched, runner, 0.0) == ["b"]
    assert step(sched, runner, 0.5) == ["a", "b"]  # a's listener has heard 0.5 s: 0.83 s left, under the lead


def test_off_by_default_every_running_request_steps() -> None:
    sched, runner = make(speech_lead_s=0.0)
    sched.add(new("a", [1, 2, 3], max_tokens=100), 0.0)
    for _ in range(10):
        step(sched, runner, 0.0)
    sched.add(new("b", list(range(10, 20)), max_tokens=100), 0.0)
    assert step(sched, runner, 0.0) == ["a", "b"]
    assert sched.stats()["num_lead_skips"] == 0


def test_a_reply_ahead_still_steps_when_the_one_behind_cannot_be_admitted() -> None:
    sched, runner = make(num_pages=4)  # 16 tokens of KV in all
    sched.add(new("a", [1, 2, 3], max_tokens=100), 0.0)
    for _ in range(int(TOKENS_PER_SPEECH_S) + 2):
        step(sched, runner, 0.0)  # a: 11 tokens, 3 pages
    sched.add(new("b", list(range(10, 20)), max_tokens=100), 0.0)  # needs 3 pages: 1 is free
    assert step(sched, runner, 0.0) == ["a"]  # not a stall: nobody sits out when those behind cannot run
    assert sched.stats()["num_lead_skips"] == 0


def test_the_stage_field_reaches_the_scheduler_and_is_checked() -> None:
    class Runner:
        ar_spec = ARSpec(8, 4, 32, ())

    stage = StageConfig(name="t", factory="m:f", scheduler="ar", speech_lead_s=1.5)
    sched = SCHEDULER_BUILDERS["ar"](stage, Runner())  # type: ignore[arg-type]
    assert isinstance(sched, ARScheduler) and sched._lead is not None and sched._lead.lead_s == 1.5
    with pytest.raises(ConfigError, match="speech_lead_s"):
        StageConfig(name="t", factory="m:f", scheduler="ar", speech_lead_s=-1.0)
    with pytest.raises(ValueError, match="lead_s"):
        SpeechLead(0.0)
