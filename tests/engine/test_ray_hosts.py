"""The Ray back-end's stage hosts (`engine/ray_hosts.py`) on a two-node cluster of this host (`tests/ray_cluster.py`).

NOTE: the hosts run `ray_cluster.stand_in_stage` instead of `bootstrap.start_stage_process` (the `target` that only
tests give): what is under test is where a child runs and how its end is seen, not a stage, and a real stage would
take seconds to load. The production path differs only in that target.
"""

from __future__ import annotations

import itertools
import os
import select
import signal
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import ray
from harness import shm_segments, wait_for
from ray_cluster import HEAD_IP, ROLE, WORKER_IP, TwoNodeCluster, is_running, read_report, stand_in_spec, stand_in_stage

from voice_server.config.placement import Placement
from voice_server.engine.ray_hosts import RayHosts
from voice_server.engine.ray_process import RayProcess

PLACEMENTS = {
    "thinker": Placement(node_labels={ROLE: "thinker"}),
    "talker": Placement(resources={"worker_host": 1}),
    "code2wav": Placement(node_labels={ROLE: "talker"}),
    "asr": Placement(),
}
_launches = itertools.count()


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TwoNodeCluster]:
    nodes = TwoNodeCluster(tmp_path_factory.mktemp("ray"))
    try:
        yield nodes.start()
    finally:
        nodes.shutdown()


@pytest.fixture
def hosts(cluster: TwoNodeCluster) -> Iterator[RayHosts]:
    placed = RayHosts(f"rh{os.getpid()}x{next(_launches)}", cluster.address, PLACEMENTS, target=stand_in_stage)
    handler, env = signal.getsignal(signal.SIGTERM), dict(os.environ)
    placed.start(timeout_s=30.0)
    # NOTE: ray.init sets its own handler and PYTHONBREAKPOINT: the server's must stay
    assert (signal.getsignal(signal.SIGTERM), dict(os.environ)) == (handler, env)
    try:
        yield placed
    finally:
        placed.close()


def spawn(hosts: RayHosts, process: str, report: Path, exit_code: int | None = None) -> tuple[RayProcess, dict]:
    spec = stand_in_spec(hosts.launch_id, f"{process}.0", report, exit_code)
    child = hosts.spawn(process, {"VS_TEST_MARK": process}, spec)
    return child, read_report(report)


def ended(child: RayProcess, timeout_s: float) -> float:
    """Seconds until the sentinel became readable, as the supervisor's event loop sees it."""
    start = time.monotonic()
    readable, _, _ = select.select([child.sentinel], [], [], timeout_s)
    assert readable, f"the sentinel of {child.pid} did not fire within {timeout_s:g} s"
    return time.monotonic() - start


def test_each_process_runs_on_the_node_its_placement_asks_for(hosts: RayHosts) -> None:
    driver = hosts.driver_node_id()
    assert hosts.node_ip("thinker") == HEAD_IP and hosts.node_id("thinker") == driver
    assert hosts.node_ip("talker") == WORKER_IP and hosts.node_ip("code2wav") == WORKER_IP
    assert hosts.node_id("talker") == hosts.node_id("code2wav") != driver
    assert hosts.node_id("asr") == driver  # NOTE: no placement: beside the server
    port = hosts.free_port("talker")
    with socket.socket() as sock:
        sock.bind((WORKER_IP, port))


def test_a_child_runs_in_its_host_and_its_end_shows_on_the_sentinel(hosts: RayHosts, tmp_path: Path) -> None:
    child, facts = spawn(hosts, "talker", tmp_path / "a.json")
    assert facts["pid"] == child.pid and is_running(child.pid)
    assert facts["ppid"] == hosts._host("talker").actor_pid  # NOTE: the actor on 127.0.0.3 is its parent
    assert facts["mark"] == "talker"
    assert not facts["has_ray"], "the child re-ran Ray's worker script as its __main__"
    # NOTE: Ray sets it (and OMP_NUM_THREADS) in its workers: the child gets what the node gave the actor instead
    assert facts["breakpoint"] == os.environ.get("PYTHONBREAKPOINT")
    assert child.is_alive() and child.exitcode is None
    assert shm_segments(hosts.launch_id) == [f"vs-{hosts.launch_id}-talker.0-0"]
    child.kill()
    ended(child, 2.0)
    child.join(1.0)
    assert (child.exitcode, child.death_reason, child.is_alive()) == (-signal.SIGKILL, None, False)
    assert shm_segments(hosts.launch_id) == []  # NOTE: swept by the host before `wait` returned
    child.close()
    child.close()

    child, _ = spawn(hosts, "talker", tmp_path / "b.json")
    child.terminate()
    ended(child, 5.0)
    assert child.exitcode == -signal.SIGTERM
    child, _ = spawn(hosts, "code2wav", tmp_path / "c.json", exit_code=3)
    ended(child, 5.0)
    assert child.exitcode == 3 and child.death_reason is None
    child.kill()  # NOTE: gone already: a no-op
    with pytest.raises(ValueError):
        spawn(hosts, "asr", tmp_path / "d.json")[0].close()


def test_killing_a_host_kills_its_child_and_a_new_host_sweeps_what_it_left(hosts: RayHosts, tmp_path: Path) -> None:
    child, _ = spawn(hosts, "code2wav", tmp_path / "a.json")
    ray.kill(hosts._host("code2wav").actor)
    ended(child, 2.0)
    assert child.exitcode == -signal.SIGKILL
    assert child.death_reason is not None and "code2wav" in child.death_reason and "died" in child.death_reason
    assert not hosts.is_host_alive("code2wav") and hosts.is_host_alive("talker")
    assert wait_for(lambda: not is_running(child.pid), 5.0), "the child outlived its host"
    # NOTE: what a stage SIGKILLed mid-write would leave, and no host of the node swept (the stand-in's own segment
    # may be there too: it dies of PDEATHSIG's SIGTERM without cleaning up).
    Path("/dev/shm", f"vs-{hosts.launch_id}-code2wav.7-3").write_bytes(b"x")
    assert hosts.replace_host("code2wav", timeout_s=20.0)
    assert hosts.is_host_alive("code2wav") and hosts.node_ip("code2wav") == WORKER_IP
    assert shm_segments(hosts.launch_id) == []
    child, facts = spawn(hosts, "code2wav", tmp_path / "b.json")
    assert facts["ppid"] == hosts._host("code2wav").actor_pid
    child.kill()
    ended(child, 5.0)


def test_a_lost_node_ends_its_children_until_a_node_takes_them_again(
    cluster: TwoNodeCluster, hosts: RayHosts, tmp_path: Path,
) -> None:
    child, _ = spawn(hosts, "talker", tmp_path / "a.json")
    beside, _ = spawn(hosts, "thinker", tmp_path / "b.json")
    try:
        cluster.remove_worker()  # NOTE: a crash: its raylet and workers are SIGKILLed
        ended(child, 5.0)
        assert child.exitcode == -signal.SIGKILL
        assert child.death_reason is not None and WORKER_IP in child.death_reason
        assert not hosts.is_host_alive("talker")
        assert wait_for(lambda: not hosts.is_host_alive("code2wav"), 5.0), "the host watch missed the node's loss"
        assert hosts.is_host_alive("thinker") and beside.is_alive()
        assert not hosts.replace_host("talker", timeout_s=1.0)
    finally:
        cluster.add_worker()
    assert hosts.replace_host("talker", timeout_s=30.0)
    assert hosts.node_ip("talker") == WORKER_IP and hosts.node_id("talker") == cluster.worker.node_id
    child, facts = spawn(hosts, "talker", tmp_path / "c.json")
    assert facts["ppid"] == hosts._host("talker").actor_pid


def test_close_leaves_no_hosts_children_or_segments(hosts: RayHosts, tmp_path: Path) -> None:
    children = [spawn(hosts, p, tmp_path / f"{p}.json")[0] for p in PLACEMENTS]
    actor_pids = [hosts._host(p).actor_pid for p in PLACEMENTS]
    assert len(shm_segments(hosts.launch_id)) == len(PLACEMENTS)
    hosts.close()
    assert [c.exitcode for c in children] == [-signal.SIGTERM] * len(children)
    assert shm_segments(hosts.launch_id) == []
    assert wait_for(lambda: not any(is_running(pid) for pid in actor_pids), 5.0), "an actor survived close"
    assert not any(is_running(c.pid) for c in children)
    assert not ray.is_initialized()
    hosts.close()


def test_the_production_target_runs_in_the_host(cluster: TwoNodeCluster) -> None:
    # NOTE: `bootstrap.start_stage_process` itself, given a spec it cannot unpickle: it is imported and run in the
    # child of a host on the worker node, and fails there (exit code 1) after applying `env`.
    placed = RayHosts(f"rh{os.getpid()}x{next(_launches)}", cluster.address, {"talker": PLACEMENTS["talker"]})
    placed.start(timeout_s=30.0)
    try:
        child = placed.spawn("talker", {"VS_TEST_MARK": "talker"}, b"not a pickle")
        ended(child, 20.0)
        assert (child.exitcode, child.death_reason) == (1, None)
    finally:
        placed.close()


def test_an_address_is_required_and_must_answer() -> None:
    with pytest.raises(ValueError, match="never starts one"):
        RayHosts("x", "", PLACEMENTS)
    with socket.socket() as sock:  # NOTE: a port nobody listens on (ray.init would wait minutes for it)
        sock.bind((HEAD_IP, 0))
        address = f"{HEAD_IP}:{sock.getsockname()[1]}"
    with pytest.raises(RuntimeError, match="cannot reach the Ray cluster"):
        RayHosts("x", address, PLACEMENTS).start(timeout_s=1.0)
    assert not ray.is_initialized()


def test_what_cannot_be_placed_is_named(cluster: TwoNodeCluster) -> None:
    placements = {
        "thinker": Placement(node_labels={ROLE: "thinker"}),
        "talker": Placement(node_labels={ROLE: "talker"}, resources={"gpu_host": 1}),
        "asr": Placement(node_labels={ROLE: "in(edge, phone)"}),
    }
    placed = RayHosts(f"rh{os.getpid()}x{next(_launches)}", cluster.address, placements, target=stand_in_stage)
    lacking = r"no live node .* of talker \(bundle 1: .*gpu_host.*; asr \(bundle 2"
    with pytest.raises(RuntimeError, match=lacking) as info:
        placed.start(timeout_s=1.0)
    assert "thinker" not in str(info.value)
    assert not ray.is_initialized()
    placed.close()
