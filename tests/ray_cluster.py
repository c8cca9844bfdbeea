"""A two-node Ray cluster on this host for the Ray back-end's tests, and the stage stand-in their hosts run.

The nodes are `ray.cluster_utils.Cluster` nodes (never `ray start`/`ray stop`: `ray stop` kills every Ray
process of the machine) on two loopback IPs: the head on 127.0.0.2 (resource `head_host`, label role=thinker),
the worker on 127.0.0.3 (`worker_host`, role=talker); 127.0.0.1 itself would be rewritten to eth0's address.
The worker can be removed (a crash, by default) and added back with the same resources and labels.

NOTE: this module is imported by the stand-in's processes too (a Ray worker unpickles `stand_in_stage` by
reference, and so does the child it spawns): it imports Ray only inside `TwoNodeCluster`.
"""

from __future__ import annotations

import json
import os
import pickle
import shutil
import signal
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HEAD_IP = "127.0.0.2"
WORKER_IP = "127.0.0.3"
ROLE = "voice-server/role"
_TESTS = str(Path(__file__).resolve().parent)
_MAX_TMP_LEN = 40
"""NOTE: Ray's socket paths under RAY_TMPDIR (`ray/session_<date>_<pid>/sockets/...`) must fit in 107 bytes."""
_ENV = {
    "RAY_memory_monitor_refresh_ms": "0",
    "RAY_USAGE_STATS_ENABLED": "0",
    # NOTE: a crashed node is declared dead after period x threshold of missed health checks (15 s and more by
    # default): these make it ~1 s. The GCS reads them when the head starts.
    "RAY_health_check_initial_delay_ms": "0",
    "RAY_health_check_period_ms": "300",
    "RAY_health_check_timeout_ms": "300",
    "RAY_health_check_failure_threshold": "3",
}
_NODE = {"num_cpus": 1, "include_dashboard": False, "object_store_memory": 80 * 2**20}


class TwoNodeCluster:
    def __init__(self, tmp_dir: Path) -> None:
        self._own_tmp = len(str(tmp_dir)) > _MAX_TMP_LEN
        self.tmp_dir = Path(tempfile.mkdtemp(prefix="ray", dir="/tmp")) if self._own_tmp else tmp_dir
        self._saved_env: dict[str, str | None] = {}
        self.cluster: Any = None
        self.worker: Any = None

    @property
    def address(self) -> str:
        return str(self.cluster.address)

    def start(self) -> TwoNodeCluster:
        from ray.cluster_utils import Cluster

        # NOTE: the nodes (and the workers their raylets start) inherit this environment: PYTHONPATH lets a
        # worker import this module, for `stand_in_stage`.
        env = dict(_ENV, RAY_TMPDIR=str(self.tmp_dir),
                   PYTHONPATH=os.pathsep.join(p for p in (_TESTS, os.environ.get("PYTHONPATH")) if p))
        for key, value in env.items():
            self._saved_env[key] = os.environ.get(key)
            os.environ[key] = value
        head = dict(_NODE, node_ip_address=HEAD_IP, resources={"head_host": 1}, labels={ROLE: "thinker"})
        self.cluster = Cluster(initialize_head=True, head_node_args=head)
        self.add_worker()
        return self

    def connect_driver(self) -> None:
        """Join the cluster from this process through the head's raylet, as a server on the head host would.

        NOTE: left to itself, a driver on this host attaches to any raylet of it (the worker's, once), and a node a
        driver is attached to cannot be removed. `RayHosts.start` keeps a connection it finds."""
        import ray

        handler = signal.getsignal(signal.SIGTERM)
        try:
            ray.init(address=self.address, _node_ip_address=HEAD_IP)
        finally:
            signal.signal(signal.SIGTERM, handler)  # NOTE: ray.init sets its own on the main thread

    def add_worker(self) -> None:
        assert self.worker is None
        self.worker = self.cluster.add_node(**_NODE, node_ip_address=WORKER_IP, resources={"worker_host": 1},
                                            labels={ROLE: "talker"})

    def remove_worker(self, is_graceful: bool = False) -> None:
        """Kill the worker node's processes: at once (a crash) unless `is_graceful`."""
        self.cluster.remove_node(self.worker, allow_graceful=is_graceful)
        self.worker = None

    def shutdown(self) -> None:
        import ray

        try:
            if ray.is_initialized():
                ray.shutdown()
            if self.cluster is not None:
                self.cluster.shutdown()
        finally:
            for key, value in self._saved_env.items():
                if value is None:
                    os.environ.pop(key, None)
                else:
                    os.environ[key] = value
            if self._own_tmp:
                shutil.rmtree(self.tmp_dir, ignore_errors=True)


def stand_in_spec(launch_id: str, owner: str, report: Path, exit_code: int | None = None) -> bytes:
    return pickle.dumps({"launch_id": launch_id, "owner": owner, "report": str(report), "exit_code": exit_code})


def stand_in_stage(env: dict[str, str], spec_bytes: bytes) -> None:
    """What a `StageHost` runs here instead of `bootstrap.start_stage_process`: applies `env`, dies with its
    parent as a stage does, leaves a relay segment that only a sweep removes, reports where it runs, then exits
    with `exit_code` or runs until a signal ends it."""
    os.environ.update(env)
    spec = pickle.loads(spec_bytes)
    from voice_server.engine.ipc import die_with_parent
    from voice_server.relay.shm_segments import SHM_DIR, segment_name

    die_with_parent()
    with open(os.path.join(SHM_DIR, segment_name(spec["launch_id"], spec["owner"], 0)), "wb") as f:
        f.write(b"\0" * 4096)
    facts = {"pid": os.getpid(), "ppid": os.getppid(), "mark": os.environ.get("VS_TEST_MARK"),
             "has_ray": "ray" in sys.modules, "breakpoint": os.environ.get("PYTHONBREAKPOINT")}
    Path(spec["report"] + ".tmp").write_text(json.dumps(facts))
    os.replace(spec["report"] + ".tmp", spec["report"])
    if spec["exit_code"] is not None:
        sys.exit(spec["exit_code"])
    while True:
        signal.pause()


def read_report(path: Path, timeout_s: float = 10.0) -> dict[str, Any]:
    deadline = time.monotonic() + timeout_s
    while not path.exists():
        assert time.monotonic() < deadline, f"the stand-in wrote no {path}"
        time.sleep(0.02)
    facts: dict[str, Any] = json.loads(path.read_text())
    return facts


def is_running(pid: int) -> bool:
    """Whether `pid` is a live process (a zombie is not)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rpartition(")")[2].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError):
        return False

