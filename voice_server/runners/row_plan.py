"""How many rows an AR step gives its matrix products so that every row's bits are independent of the
batch: `RowPlan`, found at start-up by `probe_row_plan` on the model's own linear modules.

NOTE: BLAS picks kernels by the row count M, and kernels round differently (~1e-6). What it picks is
the CPU's and the library's business, not a law: on an AMD EPYC (MKL 2024.2, AVX-512) fp32 M=1 is a
GEMV, M=2..3 one GEMM kernel and M>=4 another, so padding every step to 4 rows is enough; with
MKL's `MKL_CBWR=COMPATIBLE` code path (and on the Intel Xeon where issue #18 was found) M=8, 12, 16...
agree but every other M differs, so steps are padded to a multiple of 4 from 8 rows. The probe tries
the cheap plans in order; when none holds for every probed row count up to the step's largest, the
runner still starts, batching as it comes (`is_batch_invariant` False, one warning, reported in
`/health` and the stage's stats): a sequence's logits may then differ in their last bits alone and in
a batch, and greedy ids may flip on a near tie.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

log = logging.getLogger(__name__)

ROW_MULTIPLES = (1, 2, 4, 8, 16, 32)
MAX_MIN_ROWS = 32
"""Past these a lone decode row would pay for dozens of padding rows: batching without invariance is the
better trade (one warning says so)."""
_DENSE_UNTIL = 64
"""Every row count up to this is probed; beyond it, counts around the powers of two up to the step's largest."""


@dataclass(frozen=True)
class RowPlan:
    """A step of n rows runs `num_rows(n)` rows: at least `min_rows`, rounded up to a multiple of
    `row_multiple`. `is_batch_invariant` False: no padding made rows independent of the count."""

    min_rows: int = 1
    row_multiple: int = 1
    is_batch_invariant: bool = True

    def __post_init__(self) -> None:
        if self.min_rows < 1 or self.row_multiple not in ROW_MULTIPLES:
            raise ValueError(f"RowPlan: min_rows >= 1 and row_multiple in {ROW_MULTIPLES}, got {self}")

    def num_rows(self, n: int) -> int:
        return max(self.min_rows, -(-n // self.row_multiple) * self.row_multiple)

    def describe(self) -> str:
        if not self.is_batch_invariant:
            return "rows as they come (not batch invariant)"
        if self.min_rows == 1 and self.row_multiple == 1:
            return "rows as they come (batch invariant)"
        if self.row_multiple == 1:
            return f"at least {self.min_rows} rows"
        return f"at least {self.min_rows} rows, a multiple of {self.row_multiple}"


def probe_counts(max_rows: int) -> list[int]:
    """The step sizes a plan is checked at: all up to `_DENSE_UNTIL`, then around each power of two."""
    counts = set(range(1, min(max_rows, _DENSE_UNTIL) + 1))
    power = _DENSE_UNTIL
    while power < max_rows:
        power *= 2
        counts.update(c for c in (power // 2 + 1, 3 * power // 4, power - 1, power) if c <= max_rows)
    counts.add(max_rows)
    return sorted(counts)


class _Probe:
    """One module's outputs for prefixes of one input, computed on demand; `agrees(m)`: the first m rows
    of an m-row product equal those rows of the full product, and the full product's rows do not depend
    on their position (it is also computed on the rows reversed)."""

    def __init__(self, module: nn.Module, x: torch.Tensor) -> None:
        self.module, self.x = module, x
        self.ref = module(x)
        self.is_positional = not torch.equal(module(x.flip(0)).flip(0), self.ref)
        self._agrees: dict[int, bool] = {len(x): not self.is_positional}

    def agrees(self, m: int) -> bool:
        if m not in self._agrees:
            self._agrees[m] = not self.is_positional and torch.equal(self.module(self.x[:m]), self.ref[:m])
        return self._agrees[m]


def _holds(plan: RowPlan, counts: list[int], probes: list[_Probe]) -> bool:
    return all(p.agrees(plan.num_rows(n)) for n in counts for p in probes)


def _overhead(plan: RowPlan) -> float:
    """Padding factors summed over step sizes 1..64: a lone decode row weighs most, as it runs most."""
    return sum(plan.num_rows(n) / n for n in range(1, _DENSE_UNTIL + 1))


@torch.no_grad()
def probe_row_plan(modules: Iterable[nn.Module], in_dtype: torch.dtype, max_rows: int) -> tuple[RowPlan, str]:
    """The cheapest `RowPlan` under which every linear of `modules` gives each row the same bits for every
    step size up to `max_rows`, and "" ; or a non-invariant plan and what broke it (for the warning).

    Probed on the model's own modules (float or quantised: their kernels choose differently), since the
    choice may also depend on N and K; modules of one type and weight shape are probed once."""
    counts = probe_counts(max_rows)
    candidates = sorted({RowPlan(max(m0, q), q) for q in ROW_MULTIPLES for m0 in range(1, MAX_MIN_ROWS + 1)},
                        key=lambda p: (_overhead(p), p.min_rows))
    largest = max(c.num_rows(max_rows) for c in candidates)
    gen = torch.Generator().manual_seed(0)
    probes: list[_Probe] = []
    names: list[str] = []
    seen: set[tuple[Any, ...]] = set()
    for module in modules:
        tensors = list(module.parameters()) + list(module.buffers())
        in_features = getattr(module, "in_features", None)
        if not tensors or not isinstance(in_features, int):
            continue
        weight = max(tensors, key=lambda t: t.numel())
        key = (type(module), in_features, tuple(weight.shape), tuple(weight.stride()), weight.dtype)
        if key in seen:
            continue
        seen.add(key)
        x = torch.randn(largest, in_features, generator=gen).to(weight.device, in_dtype)
        probes.append(_Probe(module, x))
        names.append(f"{type(module).__name__}({in_features} -> {tuple(weight.shape)}, {weight.dtype})")
    if not probes:
        return RowPlan(), ""
    for plan in candidates:
        if _holds(plan, counts, probes):
            return plan, ""
    # NOTE: name the modules that no plan fixes on their own (or all, if only their combination fails).
    broken = [name for name, probe in zip(names, probes, strict=True)
              if not any(_holds(c, counts, [probe]) for c in candidates)]
    return RowPlan(is_batch_invariant=False), ", ".join(broken or names)


def plan_rows(modules: Iterable[nn.Module], in_dtype: torch.dtype, max_rows: int, *, is_wanted: bool) -> RowPlan:
    """The runner's plan: probed when batch invariance is wanted; otherwise rows as they come."""
    if not is_wanted:
        return RowPlan()
    modules = list(modules)
    plan, broken = probe_row_plan(modules, in_dtype, max_rows)
    if not plan.is_batch_invariant:
        log.warning("batch_invariant: no padding up to %d rows (multiples up to %d) makes the rows of %s independent "
                    "of the row count on %s; steps batch their rows as they come, so a sequence's logits may "
                    "differ in the last bits alone and in a batch (batch_invariant: false silences this)",
                    MAX_MIN_ROWS, ROW_MULTIPLES[-1], broken, _kernels(modules))
    return plan


def _kernels(modules: list[nn.Module]) -> str:
    """Whose kernels were probed, for the warning: the device's (a GPU's name, or the CPU's kernel level)."""
    device = next((p.device for m in modules for p in m.parameters()), torch.device("cpu"))
    if device.type == "cuda":
        return f"{device} ({torch.cuda.get_device_name(device)})"
    return f"this CPU's BLAS ({torch.backends.cpu.get_cpu_capability()})"
