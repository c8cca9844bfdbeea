"""Only the processes of one launch may talk on its control plane; malformed or foreign messages
are dropped and counted, never fatal."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgpack
import numpy as np
import pytest
import zmq
from harness import LoopThread, Pipeline, wait_for

from voice_server.config import pipeline_from_dict
from voice_server.engine.coordinator import Coordinator

STAGES = [
    {"name": "framer", "factory": "voice_server.stages.numeric:create_framer", "stream_to": ["sink"],
     "factory_args": {"frame_len": 8}},
    {"name": "sink", "factory": "voice_server.stages.numeric:create_sink", "terminal": True},
]
# Tags of engine/messages.py: 0 NewRequest, 1 StreamChunk, 5 Failure, 6 Ready, 7 StartupFailed.
MALFORMED_WORK = [
    [0, ["not", "a", "str"], "framer", {}, {}],  # request id of the wrong type
    [0, "r1", "framer", "payload-not-a-map", {}],
    [0, "r2", "framer", {}, 7],
    [0, "r3", "framer", {1: "int key"}, {}],
    [1, "r4", "framer", "seq", {}],
    [0, "r5", "no_such_stage", {}, {}],  # well-typed, but for a stage this process does not run
]


@pytest.fixture(scope="module")
def ipc_pipeline() -> Iterator[Pipeline]:
    pipeline = Pipeline(pipeline_from_dict({"name": "cp", "stages": STAGES}))
    yield pipeline
    pipeline.close()


def works(pipeline: Pipeline) -> bool:
    signal = np.arange(20, dtype=np.float32)
    outputs = pipeline.collect({"signal": signal})
    return [o.payload.get("index") for o in outputs] == [0, 1, 2, None]


def push(address: str, frames: list[bytes], curve: dict[str, bytes] | None = None) -> None:
    ctx = zmq.Context()
    try:
        sock = ctx.socket(zmq.PUSH)
        sock.setsockopt(zmq.LINGER, 1000)
        if curve is not None:
            sock.curve_serverkey, sock.curve_publickey, sock.curve_secretkey = (
                curve["server"], curve["public"], curve["secret"])
        sock.connect(address)
        for frame in frames:
            sock.send(frame)
        time.sleep(0.3)
        sock.close()
    finally:
        ctx.term()


def dropped(pipeline: Pipeline) -> dict[str, int]:
    stats = pipeline.run(pipeline.coordinator.stats())
    return {"coord": pipeline.coordinator.num_dropped_messages,
            **{name: reply.num_dropped_messages for name, reply in stats.items()}}


def wait_dropped(pipeline: Pipeline, at_least: dict[str, int]) -> dict[str, int]:
    """The drop counts once each process named in `at_least` has counted that many (or after 10 s)."""
    def reached() -> dict[str, int] | None:
        counts = dropped(pipeline)
        return counts if all(counts[name] >= num for name, num in at_least.items()) else None

    return wait_for(reached) or dropped(pipeline)


def test_ipc_sockets_live_in_a_private_directory(ipc_pipeline: Pipeline) -> None:
    coordinator = ipc_pipeline.coordinator
    run_dir = coordinator.run_dir.path
    st = os.stat(run_dir)
    assert stat.S_IMODE(st.st_mode) == 0o700 and st.st_uid == os.getuid()
    for address in [*coordinator.endpoints.inboxes.values(), coordinator.endpoints.broadcast]:
        assert address.startswith(f"ipc://{run_dir}/")  # not the abstract namespace (`ipc://@`)
    assert "launch_id" not in coordinator.health()


def test_malformed_and_foreign_messages_are_dropped_and_counted(ipc_pipeline: Pipeline) -> None:
    coordinator = ipc_pipeline.coordinator
    before = dropped(ipc_pipeline)
    push(coordinator.endpoints.inboxes["framer"], [msgpack.packb(m) for m in MALFORMED_WORK])
    handle = coordinator.launcher.handles["framer"]
    # A forged StartupFailed for the live generation once marked a ready stage failed for good.
    forged = [[7, "framer", handle.generation, "forged"], [6, "sink", 0, 4242], [5, 7, "framer", "x"]]
    push(coordinator.endpoints.inboxes["coord"], [msgpack.packb(m) for m in forged])
    after = wait_dropped(ipc_pipeline, {"framer": before["framer"] + len(MALFORMED_WORK),
                                        "coord": before["coord"] + len(forged)})
    assert after["framer"] - before["framer"] == len(MALFORMED_WORK)
    assert after["coord"] - before["coord"] == len(forged)
    assert coordinator.is_ready and handle.generation == 0
    assert works(ipc_pipeline)


OUTSIDER = """
import json, os, sys, time, zmq
run_dir, address = sys.argv[1], sys.argv[2]
os.setgid(65534); os.setuid(65534)  # after the imports: the interpreter lives under /root
result = {}
try:
    os.listdir(run_dir)
    result["listdir"] = "ok"
except PermissionError:
    result["listdir"] = "denied"
ctx = zmq.Context()
sock = ctx.socket(zmq.PUSH)
sock.connect(address)
for _ in range(5):
    sock.send(b"\\xc1junk")
time.sleep(0.5)  # NOTE: for the negative check: time for the junk to get out had the connect succeeded
sock.close(linger=0)
ctx.term()
print(json.dumps(result))
"""


@pytest.mark.environment
@pytest.mark.skipif(os.getuid() != 0, reason="environment: needs root to act as another user")
def test_another_user_cannot_reach_the_control_plane(ipc_pipeline: Pipeline) -> None:
    coordinator = ipc_pipeline.coordinator
    before = dropped(ipc_pipeline)
    for process in ("coord", "framer"):
        out = subprocess.run(
            [sys.executable, "-c", OUTSIDER, coordinator.run_dir.path, coordinator.endpoints.inboxes[process]],
            capture_output=True, text=True, timeout=30,
        )
        assert out.returncode == 0, out.stderr
        assert json.loads(out.stdout) == {"listdir": "denied"}
    assert dropped(ipc_pipeline) == before  # nothing arrived
    push(coordinator.endpoints.inboxes["coord"], [b"\xc1junk"])  # the launch's own user gets through
    # NOTE: exactly one: the outsider's junk, sent earlier, has not arrived by the time this did either.
    assert wait_dropped(ipc_pipeline, {"coord": before["coord"] + 1})["coord"] == before["coord"] + 1
    assert works(ipc_pipeline)


def test_tcp_control_plane_admits_only_the_launch_keys() -> None:
    pipeline = Pipeline(pipeline_from_dict({"name": "cp", "control_transport": "tcp", "stages": STAGES}))
    try:
        coordinator = pipeline.coordinator
        keys = coordinator.endpoints.curve
        assert keys is not None
        address = coordinator.endpoints.inboxes["coord"]
        before = dropped(pipeline)
        public, secret = zmq.curve_keypair()
        push(address, [b"\xc1junk"])  # no CURVE at all
        push(address, [b"\xc1junk"], {"server": keys.server_public, "public": public, "secret": secret})
        # NOTE: a negative check, so a fixed sleep: `push` returns once its junk went out or its linger
        # (1 s) expired; this is time for the coordinator to count junk that got through.
        time.sleep(0.2)
        assert dropped(pipeline) == before
        # The check can see delivery: the launch's own client key gets through (and junk is counted).
        launch: dict[str, Any] = {"server": keys.server_public, "public": keys.client_public,
                                  "secret": keys.client_secret}
        push(address, [b"\xc1junk"], launch)
        assert wait_dropped(pipeline, {"coord": before["coord"] + 1})["coord"] == before["coord"] + 1
        assert works(pipeline)
    finally:
        pipeline.close()


def test_a_run_directory_others_can_enter_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                     caplog: pytest.LogCaptureFixture) -> None:
    run_base = tmp_path / "run"
    run_base.mkdir()
    run_base.chmod(0o755)
    monkeypatch.setenv("VOICE_SERVER_RUN_DIR", str(run_base))
    lt = LoopThread()
    coordinator = Coordinator(pipeline_from_dict({"name": "cp", "stages": STAGES}))
    try:
        with pytest.raises(PermissionError, match=f"run directory {run_base} must be .* mode 0700"):
            lt.run(coordinator.start())
    finally:
        lt.close()
    assert "cleanup step failed" not in caplog.text
    assert os.listdir(run_base) == []
