"""Where a stage's process runs when the pipeline is placed on a Ray cluster (`launcher: ray`).

A stage's `placement` names what the node of its process must offer:
- `node_labels`: Ray node labels the node must carry (`ray start --labels` / `Cluster.add_node(labels=)`),
  e.g. `{"voice-server/role": "talker"}`, in Ray's selector syntax (`!value`, `in(a, b)`, `!in(a, b)` too);
- `resources`: Ray resources its placement-group bundle reserves, e.g. custom ones given to a node at
  `ray start --resources '{"talker_host": 1}'`, or `{"GPU": 1}`.

Stages in one process group share one process, so they must agree on its placement; each replica of a
replicated stage gets a bundle of its own with the same placement. The placement itself is carried out by
`voice_server/engine/ray_hosts.py`; without `launcher: ray` a placement is refused (it would be ignored).
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from voice_server.config.errors import fail, quoted, show
from voice_server.config.topology import check_group_agrees

if TYPE_CHECKING:
    from voice_server.config.pipeline import StageConfig

MAX_ENTRIES = 16
_KEY_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.\-/]{0,62}$")
_LABEL_VALUE = r"[A-Za-z0-9_.\-]{1,63}"
_VALUE_RE = re.compile(rf"^!?(?:{_LABEL_VALUE}|in\({_LABEL_VALUE}(?:, ?{_LABEL_VALUE})*\))$")
"""A label value, or Ray's selector syntax on it: `v`, `!v`, `in(a, b)`, `!in(a, b)`."""
_RESERVED_RESOURCES = ("memory", "object_store_memory")
"""Ray accounts these in bytes per node; a stage's memory is its `memory_fraction`, checked by the budget."""


@dataclass(frozen=True)
class Placement:
    node_labels: dict[str, str] = field(default_factory=dict)
    """Labels the process's node must have (all of them)."""
    resources: dict[str, float] = field(default_factory=dict)
    """Resources the process's bundle reserves on its node."""

    def check(self, where: str) -> None:
        for name, mapping in (("node_labels", self.node_labels), ("resources", self.resources)):
            if not isinstance(mapping, dict):
                raise fail(where, f"placement.{name}", f"must be a mapping, got {show(mapping)}")
            if len(mapping) > MAX_ENTRIES:
                raise fail(where, f"placement.{name}", f"at most {MAX_ENTRIES} entries, got {len(mapping)}")
            for key in mapping:
                if not isinstance(key, str) or not _KEY_RE.match(key):
                    raise fail(where, f"placement.{name}",
                               f"key {quoted(key)} must match [A-Za-z0-9][A-Za-z0-9_.-/]* (at most 63 characters)")
        for key, value in self.node_labels.items():
            if not isinstance(value, str) or not _VALUE_RE.match(value):
                raise fail(where, f"placement.node_labels.{key}",
                           f"must be a label value of [A-Za-z0-9_.-] (at most 63 characters), or `!value`, "
                           f"`in(a, b)`, `!in(a, b)`, got {show(value)}")
        for key, amount in self.resources.items():
            if key in _RESERVED_RESOURCES:
                raise fail(where, f"placement.resources.{key}",
                           "is not placed per stage here; a stage's memory is its memory_fraction")
            if isinstance(amount, bool) or not isinstance(amount, (int, float)) or not math.isfinite(amount) \
                    or amount <= 0:
                raise fail(where, f"placement.resources.{key}", f"must be a number > 0, got {show(amount)}")

    @property
    def is_empty(self) -> bool:
        return not self.node_labels and not self.resources


def placement_from_dict(where: str, raw: Any) -> Placement | None:
    """A stage's `placement:` mapping (null or absent: none)."""
    if raw is None:
        return None
    if not isinstance(raw, dict):
        raise fail(where, "placement", f"must be a mapping with node_labels and/or resources, got {show(raw)}")
    for key in raw:
        if key not in ("node_labels", "resources"):
            raise fail(where, f"placement.{key}" if isinstance(key, str) and key.isprintable() else "placement",
                       f"unknown field {quoted(key)} (known: node_labels, resources)")
    labels = raw.get("node_labels") or {}
    resources = raw.get("resources") or {}
    placement = Placement(dict(labels) if isinstance(labels, dict) else labels,
                          dict(resources) if isinstance(resources, dict) else resources)
    placement.check(where)
    return placement


def check_process_placement(stages: Sequence[StageConfig], launcher: str) -> None:
    """Placements need the Ray launcher, and the stages of one process group must agree on theirs."""
    for stage in stages:
        if stage.placement is not None and launcher != "ray":
            raise fail(f"stage {quoted(stage.name)}", "placement",
                       f"needs `launcher: ray` (the pipeline's launcher is {launcher!r}, which runs every stage "
                       "on this host)")
    check_group_agrees(stages, "placement", "runs on one node")


def process_placement(stages: Sequence[StageConfig]) -> Placement:
    """The placement of a process group (checked consistent by `check_process_placement`); empty when none."""
    for stage in stages:
        if stage.placement is not None:
            return stage.placement
    return Placement()
