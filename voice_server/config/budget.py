"""Multi-party memory budget: each stage declares a fraction of its device's memory.

The launcher sums the declarations per device and refuses to start when any device is
over-committed, before a single process is spawned.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from voice_server.config.pipeline import ConfigError, PipelineConfig

# NOTE: fractions are user-written decimals; allow float noise (0.1 * 10 != 1.0 exactly).
_EPS = 1e-9


class BudgetError(ConfigError):
    """Some device's memory fractions add up to more than 1.0."""


@dataclass(frozen=True)
class StageBudget:
    stage: str
    device: str
    fraction: float
    num_bytes: int | None
    """Resolved for `cpu` at launch; for GPUs the stage process resolves it with torch."""


CGROUP_ROOT = "/sys/fs/cgroup"


def host_memory_bytes(cgroup_root: str = CGROUP_ROOT) -> int:
    """The RAM this process may use: physical memory, or the container's memory limit when lower.

    NOTE: in a container (a Kubernetes pod with `resources.limits.memory`, `docker run -m`) the
    physical size is the node's; CPU stages sized from it would overrun the limit and be OOM-killed.
    The limit is the cgroup's: v2 `memory.max`, v1 `memory/memory.limit_in_bytes`, read at the mount
    root, which is the container's own cgroup under a cgroup namespace (the default for containers).
    """
    physical = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    limit = cgroup_memory_limit(cgroup_root)
    return min(physical, limit) if limit is not None else physical


def cgroup_memory_limit(cgroup_root: str = CGROUP_ROOT) -> int | None:
    """The cgroup memory limit in bytes; None when there is none ("max", v1's huge sentinel) or no file."""
    for name in ("memory.max", "memory/memory.limit_in_bytes"):
        try:
            with open(os.path.join(cgroup_root, name)) as f:
                text = f.read().strip()
        except OSError:
            continue
        if text.isdigit() and int(text) < 2**62:  # NOTE: v1 writes "unlimited" as ~2**63 rounded to a page
            return int(text)
        return None
    return None


def plan_budget(cfg: PipelineConfig) -> list[StageBudget]:
    """Per-stage budgets; raises BudgetError naming every stage on an over-committed device."""
    totals: dict[str, float] = {}
    for stage in cfg.stages:
        totals[stage.device_key] = totals.get(stage.device_key, 0.0) + stage.memory_fraction
    over = {device: total for device, total in totals.items() if total > 1.0 + _EPS}
    if over:
        lines = []
        for device, total in sorted(over.items()):
            parts = ", ".join(
                f"{s.name}={s.memory_fraction:g}" for s in cfg.stages if s.device_key == device
            )
            lines.append(f"device {device} is over budget: {total:.3f} > 1.0 ({parts})")
        raise BudgetError("; ".join(lines))
    host = host_memory_bytes()
    return [
        StageBudget(
            stage=s.name,
            device=s.device_key,
            fraction=s.memory_fraction,
            num_bytes=int(host * s.memory_fraction) if s.device_key == "cpu" else None,
        )
        for s in cfg.stages
    ]


def format_budget(budgets: list[StageBudget]) -> str:
    rows = [("stage", "device", "fraction", "budget")]
    for b in budgets:
        size = f"{b.num_bytes / 2**30:.2f} GiB" if b.num_bytes is not None else "(resolved on device)"
        rows.append((b.stage, b.device, f"{b.fraction:g}", size))
    devices = sorted({b.device for b in budgets})
    for device in devices:
        total = sum(b.fraction for b in budgets if b.device == device)
        rows.append((f"total {device}", device, f"{total:g}", ""))
    widths = [max(len(r[i]) for r in rows) for i in range(4)]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows)
