"""Replicated stages (`replicas: N`): which replica serves each request, and which requests a replica holds.

The coordinator plans a request once, at submit: for each replicated stage, the ready replica with the fewest
requests in flight (it sees every request start and end, so its counts are exact without asking the stages).
The plan travels with the request (`NewRequest.replicas`) and every hop sends to the replica it names, so a
request's chunks all reach one replica (a streaming stage keeps its state per request). The stage shells
only follow plans; a plan naming a process that does not run the stage is dropped on arrival (`is_valid_plan`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

from voice_server.config import PipelineConfig
from voice_server.engine.requests import UnavailableError

ReplicaPlan = dict[str, str]
"""Replicated stage -> the process (`process@i`) that serves it for one request."""


def process_for(cfg: PipelineConfig, plan: Mapping[str, str], stage: str) -> str:
    """The process a request's message for `stage` goes to: its planned replica, else the stage's process."""
    # NOTE: a stage without replicas has one process; one the plan omits (a malformed plan is refused on
    # arrival, so only a stage of a replicated group never reached) falls back to its first replica.
    return plan.get(stage) or cfg.stage(stage).process_names[0]


def is_valid_plan(cfg: PipelineConfig, plan: Mapping[str, str]) -> bool:
    """Every planned stage exists and its process is one of that stage's replicas."""
    for stage, process in plan.items():
        try:
            config = cfg.stage(stage)
        except KeyError:
            return False
        if process not in config.process_names:
            return False
    return True


class ReplicaPlanner:
    """Per replica, the requests planned on it that have not ended; `is_ready(process)` says whether a replica
    can take a request now (its process is READY)."""

    def __init__(self, cfg: PipelineConfig, is_ready: Callable[[str], bool]) -> None:
        self.cfg, self._is_ready = cfg, is_ready
        self._stages = [cfg.stage(s) for s in cfg.reachable_from(cfg.entry_stage) if cfg.stage(s).replicas > 1]
        self._requests: dict[str, dict[str, None]] = {p: {} for s in self._stages for p in s.process_names}
        """Replica -> the ids of its requests in flight (a dict: insertion order, O(1) removal)."""
        self._plans: dict[str, ReplicaPlan] = {}

    def plan(self, request_id: str) -> ReplicaPlan:
        """Pick a replica of every replicated stage for a new request and count it there; UnavailableError
        when some replicated stage has no ready replica."""
        plan: ReplicaPlan = {}
        for stage in self._stages:
            ready = [p for p in stage.process_names if self._is_ready(p)]
            if not ready:
                raise UnavailableError(f"pipeline unavailable: no replica of stage '{stage.name}' is ready")
            # NOTE: min keeps the first of equals, so an idle pipeline fills replicas in index order.
            plan[stage.name] = min(ready, key=lambda p: len(self._requests[p]))
        if plan:
            self._plans[request_id] = plan
            for process in plan.values():
                self._requests[process][request_id] = None
        return plan

    def release(self, request_id: str) -> None:
        """The request ended (any way): its replicas are that much less loaded."""
        for process in self._plans.pop(request_id, {}).values():
            self._requests[process].pop(request_id, None)

    def is_replica(self, process: str) -> bool:
        return process in self._requests

    def requests_on(self, process: str) -> list[str]:
        """The requests in flight whose plan names `process`."""
        return list(self._requests.get(process, ()))

    def num_inflight(self, process: str) -> int:
        return len(self._requests.get(process, ()))
