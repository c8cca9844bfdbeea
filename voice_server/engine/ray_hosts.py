"""The driver side of the Ray back-end: a launch's stage hosts on a Ray cluster, one placement group, one
`StageHost` actor per stage process.

Each bundle reserves what its process's placement asks for, on a node with the labels it asks for; the process's
`StageHost` actor (the actor side: `voice_server/engine/stage_host.py`) is scheduled into that bundle and runs the
stage process as its child there, as the local launcher would (`engine/launcher.py`). `RayHosts` joins the cluster,
places the group, starts the hosts and watches each (a blocking `StageHost.hold`), spawns the stage processes
through them, and replaces a host that died. Each child is a `RayProcess` (`voice_server/engine/ray_process.py`),
the driver's view of it, which sees its death.

The server's death ends the actors (they share the driver's fate) and, through PDEATHSIG, their children. Nothing
here uses `ray.util.state`: it needs the dashboard.
"""

from __future__ import annotations

import contextlib
import logging
import signal
import threading
import time
from collections.abc import Mapping
from typing import Any

import ray
import ray.exceptions
from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from voice_server.config.placement import Placement
from voice_server.engine.bootstrap import start_stage_process
from voice_server.engine.ray_cluster import connect_cluster, labels_match
from voice_server.engine.ray_process import _POLL_S, RayProcess, _await_actor, _Host, _reason
from voice_server.engine.stage_host import StageHost, StageTarget

log = logging.getLogger("voice_server.ray_hosts")
_MAX_CONCURRENCY = 16
"""Actor threads: a wait per child (an old generation may still be exiting), the host watch, start, signals."""
_PLACEHOLDER_BUNDLE = {"memory": 1.0}
"""NOTE: Ray refuses an empty bundle; every node has `memory`, and one byte of it takes nothing from anyone."""
_NODE_ID_LABEL = "ray.io/node-id"


class StageHostLost(OSError):
    """The process's host (actor or node) is gone or does not answer: `replace_host` before the next spawn."""


_STAGE_HOST = ray.remote(StageHost)


class RayHosts:
    """A launch's stage hosts on a Ray cluster: one placement group, one StageHost actor per process.

    Thread-safe: `replace_host` may wait on a thread while the event loop spawns and watches the other processes.
    """

    def __init__(
        self, launch_id: str, address: str, placements: Mapping[str, Placement],
        target: StageTarget = start_stage_process, call_timeout_s: float = 30.0,
    ) -> None:
        if not address:
            raise ValueError("a Ray cluster address is required (RayHosts joins a cluster, it never starts one)")
        self.launch_id, self.address = launch_id, address
        self.placements = dict(placements)
        self.is_closed = False
        self._target = target
        """What a host runs in its child: `bootstrap.start_stage_process`; only tests give another."""
        self._call_timeout_s = call_timeout_s
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)
        self._num_replacing = 0
        """`replace_host` calls in flight (on other threads): `close` lets them see it before it disconnects."""
        self._is_closing = False
        self._hosts: dict[str, _Host] = {}
        self._pending: dict[str, tuple[Any, Any]] = {}
        """Process -> (actor, its `describe` ref): a new host waiting for its bundle to be placed again."""
        self._watches: list[threading.Thread] = []
        self._children: list[RayProcess] = []
        self._pg: PlacementGroup | None = None
        self._driver_node_id = ""
        self._is_connected = False

    def start(self, timeout_s: float) -> None:
        """Join the cluster, place a bundle per process, start the hosts. RuntimeError names what cannot be placed
        within `timeout_s`, and leaves nothing behind."""
        deadline = time.monotonic() + timeout_s
        left = lambda: max(0.0, deadline - time.monotonic())
        if not ray.is_initialized():
            connect_cluster(self.address, timeout_s)
            self._is_connected = True
        actors: list[Any] = []
        try:
            self._driver_node_id = ray.get_runtime_context().get_node_id()
            names = list(self.placements)
            self._pg = placement_group([self._bundle(p) for p in names], strategy="PACK",
                                       name=f"voice-server-{self.launch_id}",
                                       bundle_label_selector=[self._selector(p) for p in names])
            if not self._pg.wait(left()):
                raise RuntimeError(self._unplaced(names, timeout_s))
            actors += [self._new_actor(p, i) for i, p in enumerate(names)]
            refs = [actor.describe.remote() for actor in actors]
            ready, _ = ray.wait(refs, num_returns=len(refs), timeout=left())
            if late := [p for p, ref in zip(names, refs) if ref not in ready]:
                raise RuntimeError(f"the stage host(s) of {', '.join(late)} did not start on the Ray cluster at "
                                   f"{self.address} within {timeout_s:g} s")
            for i, (p, actor, ref) in enumerate(zip(names, actors, refs)):
                try:
                    self._install(_Host(p, i, actor, *ray.get(ref)))
                except ray.exceptions.RayActorError as exc:
                    raise RuntimeError(f"the stage host of {p} failed to start: {_reason(exc)}") from exc
        except BaseException:
            for actor in actors:  # NOTE: those not installed yet are not `close`'s to kill
                with contextlib.suppress(Exception):
                    ray.kill(actor)
            self.close()
            raise

    def _bundle(self, process: str) -> dict[str, float]:
        return {k: float(v) for k, v in self.placements[process].resources.items()} or dict(_PLACEHOLDER_BUNDLE)

    def _selector(self, process: str) -> dict[str, str]:
        placement = self.placements[process]
        if not placement.node_labels and not placement.resources:
            return {_NODE_ID_LABEL: self._driver_node_id}  # NOTE: nothing asked for: beside the server
        return dict(placement.node_labels)

    def _unplaced(self, names: list[str], timeout_s: float) -> str:
        """The processes that no live node could ever take (labels, total resources), else the group as a whole."""
        nodes = [n for n in ray.nodes() if n.get("Alive")]
        lacking = []
        for i, p in enumerate(names):
            bundle, selector = self._bundle(p), self._selector(p)
            if not any(labels_match(n.get("Labels") or {}, selector)
                       and all(n.get("Resources", {}).get(k, 0.0) >= v for k, v in bundle.items()) for n in nodes):
                lacking.append(f"{p} (bundle {i}: labels {selector}, resources {bundle})")
        head = f"cannot place the stage processes on the Ray cluster at {self.address} within {timeout_s:g} s"
        if lacking:
            return f"{head}: no live node has the labels and resources of " + "; ".join(lacking)
        return f"{head}: each fits some node, but those are taken or cannot hold {', '.join(names)} together"

    def _new_actor(self, process: str, bundle: int) -> Any:
        assert self._pg is not None
        # NOTE: num_cpus=0: the bundle has reserved the node's share. max_restarts=0: a dead host is for the
        # supervisor to restart, with backoff, through `replace_host`.
        return _STAGE_HOST.options(
            num_cpus=0, max_restarts=0, max_task_retries=0, max_concurrency=_MAX_CONCURRENCY,
            scheduling_strategy=PlacementGroupSchedulingStrategy(self._pg, placement_group_bundle_index=bundle),
        ).remote(self.launch_id, process, self._target)

    def _install(self, host: _Host) -> bool:
        with self._lock:
            if self._is_closing:
                return False
            self._hosts[host.process] = host
            watch = threading.Thread(target=self._watch_host, args=(host,), name=f"host-{host.process}", daemon=True)
            self._watches.append(watch)
        watch.start()
        return True

    def _watch_host(self, host: _Host) -> None:
        outcome = _await_actor(lambda: host.actor.hold.remote(), lambda: self.is_closed)
        # NOTE: while closing, `ray.kill` can beat the reply of a hold that `shutdown` released
        if isinstance(outcome, ray.exceptions.RayActorError) and not self._is_closing:
            self._mark_dead(host, outcome)

    def _mark_dead(self, host: _Host, exc: BaseException) -> str:
        with self._lock:
            if host.death_reason is None:
                host.death_reason = f"the stage host of '{host.process}' on node {host.node_ip} died ({_reason(exc)})"
                if not self._is_closing:
                    log.error("%s", host.death_reason)
            return host.death_reason

    def _host(self, process: str) -> _Host:
        with self._lock:
            return self._hosts[process]

    def node_ip(self, process: str) -> str:
        return self._host(process).node_ip

    def node_id(self, process: str) -> str:
        return self._host(process).node_id

    def driver_node_id(self) -> str:
        return self._driver_node_id

    def is_host_alive(self, process: str) -> bool:
        return self._host(process).death_reason is None

    def free_port(self, process: str) -> int:
        """A TCP port free (now) on the IP of the process's node."""
        port = self._call(self._host(process), "free_port")
        assert isinstance(port, int)
        return port

    def spawn(self, process: str, env: dict[str, str], spec_bytes: bytes) -> RayProcess:
        """Start the stage process in the process's host (`env` and the pickled spec as `start_stage_process` takes
        them). StageHostLost if the host is gone; an OSError of the host's (e.g. EMFILE) as OSError."""
        host = self._host(process)
        pid = self._call(host, "start", env, spec_bytes)
        assert isinstance(pid, int)
        try:
            child = RayProcess(self, host, pid)
        except BaseException:  # NOTE: no pipe or thread here (EMFILE): the child must not run unwatched
            host.actor.signal.remote(pid, signal.SIGKILL)
            raise
        with self._lock:
            self._children = [c for c in self._children if c.is_alive()] + [child]
        return child

    def _call(self, host: _Host, method: str, *args: object) -> object:
        if host.death_reason is not None:
            raise StageHostLost(host.death_reason)
        try:
            return ray.get(getattr(host.actor, method).remote(*args), timeout=self._call_timeout_s)
        except ray.exceptions.ActorUnavailableError as exc:
            raise StageHostLost(f"the stage host of '{host.process}' is unreachable: {_reason(exc)}") from exc
        except ray.exceptions.RayActorError as exc:
            raise StageHostLost(self._mark_dead(host, exc)) from exc
        except ray.exceptions.GetTimeoutError as exc:
            raise StageHostLost(f"the stage host of '{host.process}' did not answer {method} within "
                                f"{self._call_timeout_s:g} s") from exc
        except ray.exceptions.RayTaskError as exc:
            raise OSError(f"the stage host of '{host.process}' failed {method}: {exc.cause!r}") from exc

    def replace_host(self, process: str, timeout_s: float) -> bool:
        """A new host for a process whose host died, in its bundle, which Ray places again once a node can take it
        (the node IP may change). False if it is not running within `timeout_s`: the next call waits on for the
        same one. True at once if the host is alive."""
        with self._lock:
            if self._hosts[process].death_reason is None:
                return True
            if self._is_closing:
                return False
            if process not in self._pending:
                actor = self._new_actor(process, self._hosts[process].bundle)
                self._pending[process] = (actor, actor.describe.remote())
            actor, ref = self._pending[process]
            self._num_replacing += 1
        try:
            return self._await_replacement(process, actor, ref, timeout_s)
        finally:
            with self._lock:
                self._num_replacing -= 1
                self._idle.notify_all()

    def _await_replacement(self, process: str, actor: Any, ref: Any, timeout_s: float) -> bool:
        deadline = time.monotonic() + timeout_s
        while not ray.wait([ref], timeout=min(_POLL_S, max(0.0, deadline - time.monotonic())))[0]:
            if time.monotonic() >= deadline or self._is_closing:
                return False
        with self._lock:
            if self._pending.get(process, (None,))[0] is not actor:  # NOTE: another call took it, or `close`
                return self._hosts[process].death_reason is None
            del self._pending[process]
            bundle = self._hosts[process].bundle
        try:
            host = _Host(process, bundle, actor, *ray.get(ref))
        except ray.exceptions.RayActorError as exc:  # NOTE: e.g. its node died meanwhile: the next call starts over
            log.warning("a new stage host of '%s' died before it ran: %s", process, _reason(exc))
            return False
        if not self._install(host):  # NOTE: closed meanwhile
            ray.kill(host.actor)
            return False
        log.info("stage process '%s' has a new host on node %s", process, host.node_ip)
        return True

    def close(self, timeout_s: float = 5.0) -> None:
        """Stop every child (SIGTERM, SIGKILL after `timeout_s`) and sweep its node, kill the hosts, remove the
        placement group, disconnect. Idempotent."""
        with self._lock:
            if self._is_closing:
                return
            self._is_closing = True
            live = [h for h in self._hosts.values() if h.death_reason is None]
        if ray.is_initialized():
            with contextlib.suppress(ray.exceptions.RayError):
                ray.wait([h.actor.shutdown.remote(timeout_s) for h in live], num_returns=len(live),
                         timeout=timeout_s + 5.0)
        for child in self._children:
            child.join(1.0)  # NOTE: their exit codes are on the way: collected before the watches stop
        with self._lock:
            self.is_closed = True
            actors = [h.actor for h in self._hosts.values()] + [actor for actor, _ in self._pending.values()]
            self._pending.clear()
        if ray.is_initialized():
            for actor in actors:
                with contextlib.suppress(Exception):
                    ray.kill(actor)
        for thread in [*self._watches, *(c._watch for c in self._children)]:
            thread.join(2 * _POLL_S + 1.0)
        with self._idle:
            self._idle.wait_for(lambda: not self._num_replacing, 2 * _POLL_S + 1.0)
        if self._pg is not None and ray.is_initialized():
            with contextlib.suppress(Exception):
                remove_placement_group(self._pg)
        if self._is_connected:
            ray.shutdown()
            self._is_connected = False
