"""Multi-party memory budget: each stage declares a fraction of its device's memory.

The launcher sums the declarations per device and refuses to start when any device is
over-committed, before a single process is spawned.

`plan_memory` says what each budget holds, for `check-config`'s report: a stage's factory module may
define `stage_memory(stage, pipeline) -> StageMemory`, which counts the stage's weights from its model
config (on the meta device: nothing is loaded) and names its activation budget or reserve and, for an
AR stage, its KV cache's bytes per token (the cache takes the rest of the budget). The Qwen3-Omni
stages define it (`voice_server/stages/omni_parts.py`).
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from voice_server.config.errors import one_line
from voice_server.config.pipeline import ConfigError, PipelineConfig, StageConfig

# NOTE: fractions are user-written decimals; allow float noise (0.1 * 10 != 1.0 exactly).
_EPS = 1e-9


class BudgetError(ConfigError):
    """Some device's memory fractions add up to more than 1.0."""


def _node_of(cfg: PipelineConfig, process: str, nodes: Mapping[str, str] | None) -> str:
    """The host a process's device belongs to, for the sums: "" is the one host of a local launch."""
    if cfg.launcher != "ray":
        return ""
    if nodes is not None:
        return f"node {nodes[process]}"
    placement = cfg.process_placement(process)
    if placement.is_empty:
        return "any node"
    labels = [f"{k}={v}" for k, v in placement.node_labels.items()]
    resources = [f"{k}:{v:g}" for k, v in placement.resources.items()]
    return "the node of placement " + ",".join(labels + resources)


@dataclass(frozen=True)
class StageBudget:
    stage: str
    device: str
    fraction: float
    num_bytes: int | None
    """Resolved for `cpu` at launch; for GPUs the stage process resolves it with torch."""
    replicas: int = 1
    """Processes of the stage, each holding `fraction` (`StageConfig.replicas`)."""
    host: str = ""
    """Whose device it is with `launcher: ray` (a node, or before placement the node of a placement); "" on one host."""


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


def plan_budget(cfg: PipelineConfig, nodes: Mapping[str, str] | None = None) -> list[StageBudget]:
    """Per-stage budgets; raises BudgetError naming every stage on an over-committed device.

    Fractions add up per device of one host. With `launcher: ray` a host is a node: `nodes` (process -> node, once
    the processes are placed) says which; before that, processes with the same `placement` are taken to share a
    node and processes with different ones not to (the placed launch checks again with the real nodes)."""
    totals: dict[tuple[str, str], float] = {}
    holders: dict[tuple[str, str], list[str]] = {}
    for stage in cfg.stages:
        for process in stage.process_names:
            # NOTE: each replica is a process with its own model: it holds the stage's fraction once more.
            key = (_node_of(cfg, process, nodes), stage.device_key)
            totals[key] = totals.get(key, 0.0) + stage.memory_fraction
            holders.setdefault(key, []).append(stage.name)
    over = {key: total for key, total in totals.items() if total > 1.0 + _EPS}
    if over:
        lines = []
        for (node, device), total in sorted(over.items()):
            counts = {name: holders[(node, device)].count(name) for name in dict.fromkeys(holders[(node, device)])}
            parts = ", ".join(
                f"{name}={cfg.stage(name).memory_fraction:g}" + (f"x{num}" if num > 1 else "")
                for name, num in counts.items()
            )
            where = f"device {device}" + (f" on {node}" if node else "")
            lines.append(f"{where} is over budget: {total:.3f} > 1.0 ({parts})")
        raise BudgetError("; ".join(lines))
    host = host_memory_bytes()
    return [
        StageBudget(
            stage=s.name,
            device=s.device_key,
            fraction=s.memory_fraction,
            num_bytes=int(host * s.memory_fraction) if s.device_key == "cpu" else None,
            replicas=s.replicas,
            host=_node_of(cfg, s.process_names[0], nodes),
        )
        for s in cfg.stages
    ]


@dataclass(frozen=True)
class StageMemory:
    """What a stage's budget holds, as its factory module plans it (`stage_memory`)."""

    weight_bytes: int
    activation_bytes: int | None = None
    """An encoder's activation budget (the most one forward holds), or an AR stage's activation
    reserve for its steps; None when the stage plans none."""
    kv_bytes_per_token: int | None = None
    """An AR stage's KV cache, which takes what the budget leaves after weights and activations."""

    def __post_init__(self) -> None:
        for name in ("weight_bytes", "activation_bytes", "kv_bytes_per_token"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 0):
                raise ValueError(f"StageMemory.{name} must be an integer >= 0 or None, got {value!r}")


StageMemoryHook = Callable[[StageConfig, PipelineConfig], StageMemory]
"""A factory module's `stage_memory`: reads the stage's factory_args (ConfigError naming a bad one)."""
MemoryPlan = Mapping[str, StageMemory | str]
"""Stage name -> its StageMemory, or why it has none (no `stage_memory` hook, or what the hook refused)."""


def plan_memory(cfg: PipelineConfig) -> dict[str, StageMemory | str]:
    """Each stage's `stage_memory`, from its factory module (imported here: call it where torch may load)."""
    from voice_server.config.checks import resolve_factory

    plan: dict[str, StageMemory | str] = {}
    for stage in cfg.stages:
        try:
            resolve_factory(stage)  # NOTE: imports the module, or raises a ConfigError saying why it cannot
            module = importlib.import_module(stage.factory.partition(":")[0])
            hook: StageMemoryHook | None = getattr(module, "stage_memory", None)
            plan[stage.name] = "not planned by its factory" if hook is None else hook(stage, cfg)
        except ConfigError as exc:
            # NOTE: e.g. a checkpoint folder not on this host: the launch refuses it; the report says why.
            plan[stage.name] = one_line(str(exc), max_len=300)
    return plan


_DASH = "-"


def _size(num_bytes: int | None) -> str:
    if num_bytes is None:
        return _DASH
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20)):
        if num_bytes >= scale:
            return f"{num_bytes / scale:.{2 if unit == 'GiB' else 1}f} {unit}"
    return f"{num_bytes / 2**10:.1f} KiB"


def _kv(budget: StageBudget, memory: StageMemory) -> str:
    """An AR stage's KV cache: what its budget leaves after weights and activations."""
    if memory.kv_bytes_per_token is None:
        return _DASH
    per_token = f"{memory.kv_bytes_per_token / 2**10:g} KiB/token"
    if budget.num_bytes is None:
        return f"the rest ({per_token})"
    kv_bytes = budget.num_bytes - memory.weight_bytes - (memory.activation_bytes or 0)
    if kv_bytes <= 0:
        return f"none: weights and activations exceed the budget ({per_token})"
    return f"{_size(kv_bytes)} ({kv_bytes // memory.kv_bytes_per_token} tokens)"


def format_budget(budgets: list[StageBudget], memory: MemoryPlan | None = None) -> str:
    """The budget table; with `memory` (`plan_memory`), also each stage's weights, activations and KV."""
    head = ("stage", "device", "fraction", "budget")
    rows: list[tuple[str, ...]] = [head + (("weights", "activations", "KV cache") if memory is not None else ())]
    notes: list[str] = []
    for b in budgets:
        size = f"{b.num_bytes / 2**30:.2f} GiB" if b.num_bytes is not None else "(resolved on device)"
        fraction = f"{b.fraction:g}" + (f"x{b.replicas}" if b.replicas > 1 else "")
        row: tuple[str, ...] = (b.stage, b.device, fraction, size)
        if memory is not None:
            planned = memory.get(b.stage, "not planned")
            if isinstance(planned, StageMemory):
                row += (_size(planned.weight_bytes), _size(planned.activation_bytes), _kv(b, planned))
            else:
                row += ("?", "?", "?")
                notes.append(f"{b.stage}: {planned}")
        rows.append(row)
    for host, device in sorted({(b.host, b.device) for b in budgets}):
        total = sum(b.fraction * b.replicas for b in budgets if (b.host, b.device) == (host, device))
        rows.append((f"total {device}" + (f" on {host}" if host else ""), device, f"{total:g}", ""))
    widths = [max(len(r[i]) for r in rows if i < len(r)) for i in range(len(rows[0]))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]
    return "\n".join(lines + [f"  ({note})" for note in notes])
