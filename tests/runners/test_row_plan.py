"""The runner's row plan (`voice_server/runners/row_plan.py`) against stand-in linears whose rows depend
on the row count as some BLAS does, on any CPU: the cheapest padding that makes rows independent is
found and used, and where none exists the runner still starts, warns once and says so in its facts."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from typing import Any

import pytest
import torch
from ar_batches import Request, run
from row_stand_ins import (
    CountDependentLinear,
    ExactLinear,
    MultipleOfFourLinear,
    PositionalLinear,
    stand_in_llama,
)

from voice_server.runners import DecoderRunner, DecoderRunnerConfig
from voice_server.runners.row_plan import RowPlan, plan_rows, probe_counts, probe_row_plan
from voice_server.scheduling.contract import ARBatch, ARSeq, SamplingParams

torch.set_num_threads(1)
MIB = 1 << 20


def test_row_plan_pads_rows() -> None:
    assert [RowPlan(8, 4).num_rows(n) for n in (1, 7, 8, 9, 12, 13)] == [8, 8, 8, 12, 12, 16]
    assert [RowPlan(4).num_rows(n) for n in (1, 4, 5)] == [4, 4, 5]
    assert RowPlan(is_batch_invariant=False).num_rows(7) == 7
    with pytest.raises(ValueError, match="row_multiple"):
        RowPlan(8, 3)
    assert probe_counts(512)[:64] == list(range(1, 65)) and probe_counts(512)[-1] == 512
    assert probe_counts(20) == list(range(1, 21))


@pytest.mark.parametrize(("cls", "plan"), [
    (ExactLinear, RowPlan()),
    (MultipleOfFourLinear, RowPlan(8, 4)),
    (CountDependentLinear, RowPlan(is_batch_invariant=False)),
    (PositionalLinear, RowPlan(is_batch_invariant=False)),
])
def test_probe_finds_the_cheapest_plan_or_none(cls: type[ExactLinear], plan: RowPlan) -> None:
    module = cls(48, 80)
    found, broken = probe_row_plan([ExactLinear(48, 16), module], torch.float32, 200)
    assert found == plan
    # NOTE: the exact linear next to it needs no plan, so only the stand-in is named.
    assert (broken == "") == plan.is_batch_invariant
    assert broken in ("", f"{cls.__name__}(48 -> (80, 48), torch.float32)")


def test_plan_holds_beyond_the_probe_input() -> None:
    """MKL's COMPATIBLE-like pattern: padded to the plan, every step size gives a row the same bits."""
    module = MultipleOfFourLinear(32, 24)
    plan, _ = probe_row_plan([module], torch.float32, 100)
    x = torch.randn(128, 32, generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        ref = module(x)
        for n in range(1, 101):
            rows = plan.num_rows(n)
            assert torch.equal(module(x[:rows])[:n], ref[:n]), n


def test_no_plan_starts_the_runner_with_one_warning(caplog: pytest.LogCaptureFixture) -> None:
    model = stand_in_llama(CountDependentLinear)
    with caplog.at_level(logging.WARNING, logger="voice_server.runners.row_plan"):
        runner = DecoderRunner(model, None, DecoderRunnerConfig(budget_bytes=120 * MIB, page_size=4,
                                                                max_step_tokens=64))
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "batch_invariant" in warnings[0].getMessage()
    assert "CountDependentLinear" in warnings[0].getMessage()
    assert not runner.is_batch_invariant and runner.row_plan == RowPlan(is_batch_invariant=False)
    assert runner.facts() == {"batch_invariant": False, "step_rows": "rows as they come (not batch invariant)"}
    assert runner.stats() == {"batch_invariant": 0}
    prompts = {f"r{i}": [5 + i, 9, 11, 2, 30 + i] for i in range(4)}
    out = run(runner, {rid: Request(p, max_new_tokens=6, start_step=i) for i, (rid, p) in enumerate(prompts.items())})
    assert all(len(r.output) == 6 for r in out.values())
    # Asked for no invariance: no probe, no warning.
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="voice_server.runners.row_plan"):
        plan = plan_rows([CountDependentLinear(8, 8)], torch.float32, 64, is_wanted=False)
    assert plan == RowPlan() and not caplog.records


def _decode_logits(runner: DecoderRunner, chosen: list[tuple[str, list[int], tuple[int, ...]]]) -> list[torch.Tensor]:
    """Logits of one decode step of each sequence in `chosen` (its prompt prefilled first), batched together."""
    captured: list[torch.Tensor] = []
    original = runner.model.forward_paged

    def spy(*args: Any) -> torch.Tensor:
        captured.append(original(*args))
        return captured[-1]

    runner.model.forward_paged = spy  # type: ignore[method-assign]
    try:
        sp = SamplingParams()
        runner.execute(ARBatch(tuple(ARSeq(r, tuple(t[:-1]), 0, pg, False, sp) for r, t, pg in chosen)))
        runner.execute(ARBatch(tuple(ARSeq(r, (t[-1],), len(t) - 1, pg, True, sp) for r, t, pg in chosen)))
    finally:
        del runner.model.forward_paged
    return list(captured[-1])


@pytest.mark.parametrize("is_wanted", [True, False])
def test_runner_pads_to_the_plan_and_is_batch_invariant(is_wanted: bool) -> None:
    """With the plan (8 rows, a multiple of 4) a decode row's logits are the same alone and among 6
    sequences; without it (batch_invariant: false) they are not: the stand-in's pattern is real to the test."""
    runner = DecoderRunner(stand_in_llama(MultipleOfFourLinear), None, DecoderRunnerConfig(
        budget_bytes=120 * MIB, page_size=4, max_step_tokens=64, is_batch_invariant=is_wanted))
    assert runner.row_plan == (RowPlan(8, 4) if is_wanted else RowPlan())
    gen = torch.Generator().manual_seed(3)
    seqs, page = [], 0
    for i in range(6):
        tokens = torch.randint(4, 256, (3 + 5 * i,), generator=gen).tolist()
        num_pages = -(-len(tokens) // 4)
        seqs.append((f"r{i}", tokens, tuple(range(page, page + num_pages))))
        page += num_pages
    batched = _decode_logits(runner, seqs)[: len(seqs)]  # NOTE: the head's padding rows dropped
    alone = [_decode_logits(runner, [seq])[0] for seq in seqs]
    same = [torch.equal(a, b) for a, b in zip(alone, batched, strict=True)]
    assert all(same) if is_wanted else not any(same)


@pytest.mark.environment
def test_mkl_compatible_path_gets_a_plan() -> None:
    """MKL's COMPATIBLE code path (the same on every x86 CPU) rounds rows by the count as issue #18's
    Intel Xeon did, past 8 rows: a real fp32 Linear gets a plan that pads to a multiple there."""
    if not torch.backends.mkl.is_available():
        pytest.skip("environment: this torch is not built with MKL, whose MKL_CBWR the test sets")
    code = (
        "import torch; torch.set_num_threads(1)\n"
        "from voice_server.runners.row_plan import probe_row_plan\n"
        "plan, broken = probe_row_plan([torch.nn.Linear(576, 576)], torch.float32, 512)\n"
        "print(plan.min_rows, plan.row_multiple, plan.is_batch_invariant)\n"
    )
    env = {**os.environ, "MKL_CBWR": "COMPATIBLE", "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr
    min_rows, multiple, is_invariant = done.stdout.split()
    assert is_invariant == "True" and int(multiple) > 1, done.stdout
