"""Routing graph checks of a pipeline: names, targets, cycles, fan-in, reachability, process groups.

Every algorithm here is iterative and linear in stages + routes, so a hostile config (thousands of
stages, a long chain) gets a `ConfigError`, never a RecursionError or a quadratic stall. The number
of stages is bounded anyway (`MAX_STAGES`).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

from voice_server.config.errors import fail, quoted

if TYPE_CHECKING:
    from voice_server.config.pipeline import StageConfig

MAX_STAGES = 64
"""Most stages one pipeline may have (real pipelines have 2-6; each process group is an OS process)."""

RESERVED_PROCESS_NAMES = ("coord", "pub")
"""Process names the engine itself uses for socket and relay names (`engine/ipc.py`: the coordinator's
inbox and slab owner, the broadcast socket); a stage process with one of them would collide."""


def check_group_agrees(stages: Sequence[StageConfig], field: str, why: str) -> None:
    """The stages of one process group share one process, so the per-process `field` must be equal among
    them; `why` completes "which ..." in the error (what the process has one of)."""
    seen: dict[str, tuple[str, object]] = {}
    for stage in stages:
        value = getattr(stage, field)
        first = seen.setdefault(stage.process_name, (stage.name, value))
        if first[1] != value:
            raise fail(f"stage {quoted(stage.name)}", field,
                       f"differs from the {field} of stage {quoted(first[0])}: both run in process "
                       f"'{stage.process_name}', which {why}")


def check_num_stages(where: str, num_stages: int) -> None:
    if num_stages > MAX_STAGES:
        raise fail(where, "stages", f"{num_stages} stages is more than the {MAX_STAGES} a pipeline may have")


def reachable_from(by_name: Mapping[str, StageConfig], name: str) -> list[str]:
    """Stage names reachable from `name` (itself included), in breadth-first order."""
    order, seen, queue = [name], {name}, deque([name])
    while queue:
        for target in by_name[queue.popleft()].targets:
            if target not in seen:
                seen.add(target)
                order.append(target)
                queue.append(target)
    return order


def _route_field(stage: StageConfig, target: str) -> str:
    return "next" if stage.next == target else "stream_to"


def _check_acyclic(stages: Sequence[StageConfig], by_name: Mapping[str, StageConfig]) -> None:
    # NOTE: iterative DFS (white/grey/black); `path` is the grey chain, `iters` its pending targets.
    state: dict[str, int] = {}  # 1 = on the path, 2 = done
    for root in stages:
        if root.name in state:
            continue
        path = [root.name]
        iters = [iter(root.targets)]
        state[root.name] = 1
        while path:
            target = next(iters[-1], None)
            if target is None:
                state[path.pop()] = 2
                iters.pop()
                continue
            if state.get(target) == 1:
                cycle = " -> ".join([*path[path.index(target):], target])
                stage = by_name[path[-1]]
                raise fail(f"stage '{stage.name}'", _route_field(stage, target), f"routing cycle {cycle}")
            if target not in state:
                state[target] = 1
                path.append(target)
                iters.append(iter(by_name[target].targets))


def _check_replicas(stages: Sequence[StageConfig]) -> None:
    # NOTE: replicas are whole processes; a group shared with other stages would replicate them too, and a
    # request's plan picks a replica per stage, so two stages of one replicated group could disagree.
    groups: dict[str, list[str]] = {}
    for stage in stages:
        groups.setdefault(stage.process_name, []).append(stage.name)
    for stage in stages:
        others = [name for name in groups[stage.process_name] if name != stage.name]
        if stage.replicas > 1 and others:
            raise fail(
                f"stage '{stage.name}'", "replicas",
                f"a replicated stage must be alone in its process group; process '{stage.process_name}' also "
                f"holds {', '.join(others)}",
            )


def check_topology(where: str, stages: Sequence[StageConfig], entry: str) -> dict[str, StageConfig]:
    """Validate the routing graph; returns the stages by name. `entry` is the resolved entry stage."""
    check_num_stages(where, len(stages))
    by_name: dict[str, StageConfig] = {}
    for stage in stages:
        if stage.name in by_name:
            raise fail(f"stage '{stage.name}'", "name", "duplicate stage name")
        by_name[stage.name] = stage
    if entry not in by_name:
        raise fail(where, "entry", f"unknown stage {quoted(entry)}")
    for stage in stages:
        if stage.process_name in RESERVED_PROCESS_NAMES:
            field_name = "process" if stage.process else "name"
            raise fail(
                f"stage '{stage.name}'", field_name,
                f"process name '{stage.process_name}' is reserved by the engine; set 'process' to another name",
            )
        if stage.next is not None and stage.next not in by_name:
            raise fail(f"stage '{stage.name}'", "next", f"unknown stage {quoted(stage.next)}")
        for target in stage.stream_to:
            if target not in by_name:
                raise fail(f"stage '{stage.name}'", "stream_to", f"unknown stage {quoted(target)}")
        if stage.name in stage.targets:
            raise fail(f"stage '{stage.name}'", _route_field(stage, stage.name), "a stage cannot route to itself")
        if not stage.targets and not stage.terminal:
            raise fail(f"stage '{stage.name}'", "terminal", "a stage with no next/stream_to must be terminal")
    # NOTE: cycles first: a cycle entered from outside also gives one of its stages two upstreams,
    # and "fan-in" would send the user looking for the wrong mistake.
    _check_acyclic(stages, by_name)
    upstream: dict[str, str] = {}
    for stage in stages:
        for target in stage.targets:
            # NOTE: a stage sees each request once (one new_request, one stream); fan-in would
            # need a join policy the engine does not have.
            if target in upstream:
                raise fail(
                    f"stage '{target}'", "name",
                    f"has several upstream stages ({upstream[target]}, {stage.name}); fan-in is not supported",
                )
            upstream[target] = stage.name
    reachable = reachable_from(by_name, entry)
    reachable_set = set(reachable)
    for stage in stages:
        if stage.name not in reachable_set:
            raise fail(f"stage '{stage.name}'", "name", f"not reachable from entry '{entry}'")
    if not any(by_name[s].terminal for s in reachable):
        raise fail(where, "stages", "no terminal stage: set 'terminal: true' on the stage that answers")
    _check_replicas(stages)
    devices: dict[str, str] = {}
    for stage in stages:
        seen = devices.setdefault(stage.process_name, stage.device_key)
        if seen != stage.device_key:
            raise fail(
                f"stage '{stage.name}'", "device",
                f"process '{stage.process_name}' already holds a stage on {seen}",
            )
    return by_name
