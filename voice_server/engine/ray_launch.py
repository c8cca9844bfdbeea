"""The Ray back-end of the launcher (`launcher: ray`): every stage process in an actor of one placement group.

`engine/ray_hosts.py` does the Ray work (placement group, `StageHost` actors, death signals); this adapts it to
the launcher's `StageBackend`, so supervision, restarts with backoff, aborts and `/health` are the launcher's own.
What differs from a local launch:
- a process's inbox is on its node (`Endpoints.create(..., hosts=...)`), its relay is shared memory only with
  processes of its node and Mooncake across nodes (`engine/transports.py`);
- a process whose node was lost is placed again when a node can take it: until then each attempt to restart it
  fails with `PlacementPending` (a crash, so the backoff grows as for any other); the wait for a node runs on a
  thread, never on the event loop. Placed again, it gets a new inbox address, which `PeerMoved` tells everyone.
"""

from __future__ import annotations

import concurrent.futures
import logging

from voice_server.config import PipelineConfig
from voice_server.config.errors import fail
from voice_server.engine.ipc import NodeHosts, host_literal
from voice_server.engine.launcher import PlacementPending, StageProcess
from voice_server.engine.ray_hosts import RayHosts

log = logging.getLogger("voice_server.launcher")
_REPLACE_TIMEOUT_S = 30.0
"""How long one attempt waits for a node to take a lost process's bundle before the next attempt starts one."""


class RayBackend:
    def __init__(self, cfg: PipelineConfig, launch_id: str) -> None:
        placements = {process: cfg.process_placement(process) for process in cfg.processes}
        self.hosts = RayHosts(launch_id, cfg.ray_address, placements)
        self._pool = concurrent.futures.ThreadPoolExecutor(max(1, len(placements)), "voice-server-placement")
        self._replacing: dict[str, concurrent.futures.Future[bool]] = {}
        self._nodes: dict[str, str] = {}
        """Process -> the node its inbox address is on (what the endpoints were last told)."""

    def node_hosts(self) -> NodeHosts | None:
        return self

    def start(self, timeout_s: float) -> None:
        """Join the cluster and place every process (raises RuntimeError naming what cannot be placed)."""
        self.hosts.start(timeout_s)

    # -- `engine/ipc.py: NodeHosts` ------------------------------------------------------------------

    def driver_node_id(self) -> str:
        return self.hosts.driver_node_id()

    def driver_node_ip(self) -> str:
        import ray

        return str(ray.util.get_node_ip_address())

    def node_id(self, process: str) -> str:
        return self.hosts.node_id(process)

    def inbox_address(self, process: str) -> str:
        return f"tcp://{host_literal(self.hosts.node_ip(process))}:{self.hosts.free_port(process)}"

    # -- `engine/launcher.py: StageBackend` ---------------------------------------------------------

    def prepare(self, process: str) -> tuple[str, str] | None:
        if self.hosts.is_host_alive(process):
            self._replacing.pop(process, None)
            node = self.hosts.node_id(process)
            if self._nodes.setdefault(process, node) == node:
                return None
            # NOTE: a host placed again on another node (its replacement may end between two attempts)
            self._nodes[process] = node
            address = self.inbox_address(process)
            log.warning("stage process '%s' is placed again, on node %s (inbox %s)", process, node, address)
            return address, node
        future = self._replacing.get(process)
        if future is None:
            log.warning("the node of stage process '%s' is gone: waiting for a node to place it on", process)
            self._replacing[process] = self._pool.submit(self.hosts.replace_host, process, _REPLACE_TIMEOUT_S)
            raise PlacementPending(f"waiting for a node to place process '{process}' on")
        if not future.done():
            raise PlacementPending(f"waiting for a node to place process '{process}' on")
        del self._replacing[process]
        try:
            future.result()
        except Exception as exc:  # NOTE: e.g. the cluster itself is unreachable: the next attempt tries again
            raise PlacementPending(f"cannot place process '{process}': {exc}") from exc
        raise PlacementPending(f"no node could take process '{process}' within {_REPLACE_TIMEOUT_S:g} s")

    def spawn(self, process: str, env: dict[str, str], spec_bytes: bytes) -> StageProcess:
        return self.hosts.spawn(process, env, spec_bytes)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        self.hosts.close()


def check_cluster(cfg: PipelineConfig, timeout_s: float = 5.0) -> list[str]:
    """`check-config` with `launcher: ray`: where each process could run on the cluster at `ray_address`, a line
    each. A ConfigError names the first stage whose placement no live node satisfies; RuntimeError or
    ConnectionError when no cluster answers there."""
    import ray

    from voice_server.engine.ray_cluster import connect_cluster, labels_match

    is_connected_here = not ray.is_initialized()
    if is_connected_here:
        connect_cluster(cfg.ray_address, timeout_s)
    try:
        nodes = [n for n in ray.nodes() if n.get("Alive")]
        lines = []
        for process, stages in cfg.processes.items():
            placement = cfg.process_placement(process)
            if placement.is_empty:
                lines.append(f"  {process}: the server's node")
                continue
            fits = sorted({str(n.get("NodeManagerAddress")) for n in nodes
                           if labels_match(n.get("Labels") or {}, placement.node_labels)
                           and all(n.get("Resources", {}).get(k, 0.0) >= v for k, v in placement.resources.items())})
            if not fits:
                raise fail(f"stage '{stages[0].name}'", "placement",
                           f"no live node of the Ray cluster at {cfg.ray_address} has labels {placement.node_labels} "
                           f"and resources {placement.resources} ({len(nodes)} live nodes)")
            lines.append(f"  {process}: {', '.join(fits)}")
        return lines
    finally:
        if is_connected_here:
            ray.shutdown()
