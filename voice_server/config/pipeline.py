"""Pipeline configuration: a YAML file of stages, loaded into frozen, validated dataclasses.

Every validation error is a `ConfigError` whose message names the stage and the field, so a user
editing `configs/*.yaml` can find the line to fix.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

SCHEDULERS = ("simple", "ar", "code2wav")
_NAME_RE = re.compile(r"^[a-z][a-z0-9_]{0,23}$")
_DEVICE_RE = re.compile(r"^(cpu|cuda(:\d+)?)$")


class ConfigError(ValueError):
    """A pipeline config that cannot run; the message names the offending stage and field."""


def _fail(where: str, field_name: str, why: str) -> ConfigError:
    return ConfigError(f"{where}: field '{field_name}': {why}")


@dataclass(frozen=True)
class StageConfig:
    name: str
    """Unique stage name: lowercase letters, digits, '_' (it becomes part of socket names)."""
    factory: str
    """Import path `package.module:callable` of the stage's compute factory."""
    scheduler: str = "simple"
    """One of `simple`, `ar`, `code2wav`."""
    next: str | None = None
    """Stage that receives this stage's final result as a new request."""
    stream_to: tuple[str, ...] = ()
    """Stages that receive this stage's stream chunks (each gets new_request, chunks, stream_done)."""
    terminal: bool = False
    """Whether this stage's outputs (stream and result) go to the client."""
    device: str = "cpu"
    """`cpu`, `cuda` or `cuda:N`."""
    process: str = ""
    """OS process group; stages with the same value share one process. Defaults to the stage name."""
    tp_size: int = 1
    """Tensor-parallel degree (only 1 until the GPU work)."""
    memory_fraction: float = 0.05
    """Fraction of the device's memory this stage may use (host RAM for `cpu`)."""
    max_batch_size: int = 8
    """Most work items one forward call may take."""
    batch_window_ms: float = 0.0
    """How long a partial batch may wait for more work before it runs."""
    factory_args: dict[str, Any] = field(default_factory=dict)
    """Free-form keyword arguments for the factory."""

    def __post_init__(self) -> None:
        where = f"stage '{self.name}'"
        if not isinstance(self.name, str) or not _NAME_RE.match(self.name):
            raise _fail(where, "name", "must match [a-z][a-z0-9_]{0,23}")
        if not isinstance(self.factory, str) or ":" not in self.factory:
            raise _fail(where, "factory", f"must be 'package.module:callable', got {self.factory!r}")
        if self.scheduler not in SCHEDULERS:
            raise _fail(where, "scheduler", f"must be one of {', '.join(SCHEDULERS)}, got {self.scheduler!r}")
        if self.next is not None and not isinstance(self.next, str):
            raise _fail(where, "next", "must be a stage name")
        if not isinstance(self.stream_to, tuple) or not all(isinstance(s, str) for s in self.stream_to):
            raise _fail(where, "stream_to", "must be a list of stage names")
        if not isinstance(self.terminal, bool):
            raise _fail(where, "terminal", "must be true or false")
        if not isinstance(self.device, str) or not _DEVICE_RE.match(self.device):
            raise _fail(where, "device", f"must be 'cpu', 'cuda' or 'cuda:N', got {self.device!r}")
        if not isinstance(self.process, str) or (self.process and not _NAME_RE.match(self.process)):
            raise _fail(where, "process", "must match [a-z][a-z0-9_]{0,23}")
        if not isinstance(self.tp_size, int) or self.tp_size < 1:
            raise _fail(where, "tp_size", "must be an integer >= 1")
        if self.tp_size != 1:
            raise _fail(where, "tp_size", "only 1 is supported until tensor parallelism lands")
        if not isinstance(self.memory_fraction, (int, float)) or not 0.0 < self.memory_fraction <= 1.0:
            raise _fail(where, "memory_fraction", "must be in (0, 1]")
        if not isinstance(self.max_batch_size, int) or self.max_batch_size < 1:
            raise _fail(where, "max_batch_size", "must be an integer >= 1")
        if not isinstance(self.batch_window_ms, (int, float)) or self.batch_window_ms < 0:
            raise _fail(where, "batch_window_ms", "must be >= 0")
        if not isinstance(self.factory_args, dict):
            raise _fail(where, "factory_args", "must be a mapping")

    @property
    def process_name(self) -> str:
        return self.process or self.name

    @property
    def device_key(self) -> str:
        """Budget key: `cpu` or `cuda:N` (bare `cuda` is device 0)."""
        return "cuda:0" if self.device == "cuda" else self.device

    @property
    def targets(self) -> tuple[str, ...]:
        return ((self.next,) if self.next else ()) + self.stream_to


@dataclass(frozen=True)
class PipelineConfig:
    name: str
    stages: tuple[StageConfig, ...]
    entry: str = ""
    """Stage that receives new requests; defaults to the first stage."""
    startup_timeout_s: float = 120.0
    """How long a stage process may take to load and report ready."""
    inline_threshold_bytes: int = 16384
    """Tensors smaller than this travel inside the control message instead of the relay."""
    relay_slab_bytes: int = 32 << 20
    """Shared-memory slab per producer process; larger tensors use overflow segments."""
    control_transport: str = "ipc"
    """ZMQ transport of the control plane: `ipc` (one host) or `tcp`."""
    tcp_host: str = "127.0.0.1"
    """Interface the control sockets use with `control_transport: tcp`."""
    max_inflight_requests: int | None = None
    """Requests admitted at once; beyond it `submit` refuses with OverloadError. null: sized from
    the descriptor limit."""
    max_relay_bytes: int | None = None
    """Live relay bytes per producer process (slab plus overflow). null: a share of /dev/shm."""
    max_relay_segments: int | None = None
    """Live relay overflow segments per producer process (each holds a descriptor). null: sized from
    the descriptor limit."""
    request_timeout_s: float | None = None
    """Default deadline of a request; past it the request fails and is aborted everywhere. null: none."""
    restart_backoff_s: float = 0.5
    """Delay before restarting a crashed stage process; doubles per consecutive crash."""
    max_restart_backoff_s: float = 30.0
    """Cap of the restart delay."""

    def __post_init__(self) -> None:
        where = f"pipeline '{self.name}'"
        if not self.stages:
            raise _fail(where, "stages", "at least one stage is required")
        if self.startup_timeout_s <= 0:
            raise _fail(where, "startup_timeout_s", "must be > 0")
        if self.inline_threshold_bytes < 0:
            raise _fail(where, "inline_threshold_bytes", "must be >= 0")
        if self.relay_slab_bytes < 1 << 16:
            raise _fail(where, "relay_slab_bytes", "must be at least 64 KiB")
        for name in ("max_inflight_requests", "max_relay_bytes", "max_relay_segments"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
                raise _fail(where, name, "must be an integer >= 1 or null (sized from the host)")
        if self.max_relay_bytes is not None and self.max_relay_bytes < self.relay_slab_bytes:
            raise _fail(where, "max_relay_bytes", f"must be at least relay_slab_bytes ({self.relay_slab_bytes})")
        for name in ("request_timeout_s", "restart_backoff_s", "max_restart_backoff_s"):
            value = getattr(self, name)
            is_optional = name == "request_timeout_s"
            if (value is None and not is_optional) or (value is not None and (
                    not isinstance(value, (int, float)) or isinstance(value, bool) or not value > 0)):
                raise _fail(where, name, "must be a number > 0" + (" or null" if is_optional else ""))
        if self.max_restart_backoff_s < self.restart_backoff_s:
            raise _fail(where, "max_restart_backoff_s", "must be >= restart_backoff_s")
        if self.control_transport not in ("ipc", "tcp"):
            raise _fail(where, "control_transport", f"must be 'ipc' or 'tcp', got {self.control_transport!r}")
        by_name: dict[str, StageConfig] = {}
        for stage in self.stages:
            if stage.name in by_name:
                raise _fail(f"stage '{stage.name}'", "name", "duplicate stage name")
            by_name[stage.name] = stage
        if self.entry and self.entry not in by_name:
            raise _fail(where, "entry", f"unknown stage '{self.entry}'")
        for stage in self.stages:
            if stage.next is not None and stage.next not in by_name:
                raise _fail(f"stage '{stage.name}'", "next", f"unknown stage '{stage.next}'")
            for target in stage.stream_to:
                if target not in by_name:
                    raise _fail(f"stage '{stage.name}'", "stream_to", f"unknown stage '{target}'")
            if stage.name in stage.targets:
                raise _fail(f"stage '{stage.name}'", "next", "a stage cannot route to itself")
            if not stage.targets and not stage.terminal:
                raise _fail(f"stage '{stage.name}'", "terminal", "a stage with no next/stream_to must be terminal")
        upstream: dict[str, str] = {}
        for stage in self.stages:
            for target in stage.targets:
                # NOTE: a stage sees each request once (one new_request, one stream); fan-in would
                # need a join policy the engine does not have.
                if target in upstream:
                    raise _fail(
                        f"stage '{target}'", "name",
                        f"has several upstream stages ({upstream[target]}, {stage.name}); fan-in is not supported",
                    )
                upstream[target] = stage.name
        self._check_acyclic(by_name)
        reachable = self.reachable_from(self.entry_stage)
        for stage in self.stages:
            if stage.name not in reachable:
                raise _fail(f"stage '{stage.name}'", "name", f"not reachable from entry '{self.entry_stage}'")
        if not any(by_name[s].terminal for s in reachable):
            raise _fail(where, "stages", "no terminal stage: set 'terminal: true' on the stage that answers")
        devices: dict[str, str] = {}
        for stage in self.stages:
            seen = devices.setdefault(stage.process_name, stage.device_key)
            if seen != stage.device_key:
                raise _fail(
                    f"stage '{stage.name}'", "device",
                    f"process '{stage.process_name}' already holds a stage on {seen}",
                )

    def _check_acyclic(self, by_name: dict[str, StageConfig]) -> None:
        state: dict[str, int] = {}  # 1 = on the DFS stack, 2 = done

        def visit(name: str, path: list[str]) -> None:
            state[name] = 1
            for target in by_name[name].targets:
                if state.get(target) == 1:
                    cycle = " -> ".join([*path[path.index(target):], target])
                    raise _fail(f"stage '{name}'", "next/stream_to", f"routing cycle {cycle}")
                if target not in state:
                    visit(target, [*path, target])
            state[name] = 2

        for stage in self.stages:
            if stage.name not in state:
                visit(stage.name, [stage.name])

    @property
    def entry_stage(self) -> str:
        return self.entry or self.stages[0].name

    def stage(self, name: str) -> StageConfig:
        for stage in self.stages:
            if stage.name == name:
                return stage
        raise KeyError(name)

    def reachable_from(self, name: str) -> list[str]:
        """Stage names reachable from `name` (itself included), in breadth-first order."""
        order, frontier = [name], [name]
        while frontier:
            nxt = [t for s in frontier for t in self.stage(s).targets if t not in order]
            nxt = list(dict.fromkeys(nxt))
            order.extend(nxt)
            frontier = nxt
        return order

    @property
    def terminal_stages(self) -> tuple[str, ...]:
        return tuple(s for s in self.reachable_from(self.entry_stage) if self.stage(s).terminal)

    @property
    def processes(self) -> dict[str, tuple[StageConfig, ...]]:
        """Process group name -> its stages, in config order."""
        groups: dict[str, list[StageConfig]] = {}
        for stage in self.stages:
            groups.setdefault(stage.process_name, []).append(stage)
        return {name: tuple(stages) for name, stages in groups.items()}


def _build(cls: type, raw: Any, where: str) -> dict[str, Any]:
    if not isinstance(raw, dict):
        raise ConfigError(f"{where}: expected a mapping, got {type(raw).__name__}")
    known = {f.name for f in dataclasses.fields(cls)}
    for key in raw:
        if key not in known:
            raise _fail(where, str(key), f"unknown field (known: {', '.join(sorted(known))})")
    return dict(raw)


def pipeline_from_dict(raw: Any) -> PipelineConfig:
    name = raw.get("name", "pipeline") if isinstance(raw, dict) else "pipeline"
    top = _build(PipelineConfig, raw, f"pipeline '{name}'")
    raw_stages = top.get("stages")
    if not isinstance(raw_stages, list):
        raise _fail(f"pipeline '{name}'", "stages", "must be a list of stages")
    stages = []
    for i, raw_stage in enumerate(raw_stages):
        where = f"stage #{i} '{raw_stage.get('name', '?')}'" if isinstance(raw_stage, dict) else f"stage #{i}"
        kwargs = _build(StageConfig, raw_stage, where)
        for required in ("name", "factory"):
            if required not in kwargs:
                raise _fail(where, required, "missing")
        if "stream_to" in kwargs:
            value = kwargs["stream_to"]
            kwargs["stream_to"] = tuple(value) if isinstance(value, list) else (value,)
        if kwargs.get("factory_args") is None:
            kwargs.pop("factory_args", None)
        stages.append(StageConfig(**kwargs))
    top["stages"] = tuple(stages)
    top.setdefault("name", name)
    return PipelineConfig(**top)


def load_pipeline(path: str | Path) -> PipelineConfig:
    path = Path(path)
    try:
        raw = yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError) as exc:
        raise ConfigError(f"{path}: cannot read pipeline config: {exc}") from exc
    return pipeline_from_dict(raw)
