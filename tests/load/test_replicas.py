"""Scale-out: two real `voice-server serve` replicas (the stand-in speech stage) behind a real nginx
running `configs/nginx-replicas.conf`. Sessions opened through nginx spread over both replicas
(least_conn); SIGKILL of one replica's process tree closes only its own sessions, the other's keep
talking, and new sessions go to the survivor. The browser's Origin reaches the replicas' allow-list.

nginx comes from Debian (`apt-get install -y nginx`; `.ci/run` installs it for `make test`), or
$VOICE_SERVER_NGINX names the binary.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families
from websockets.exceptions import ConnectionClosed
from websockets.sync.client import ClientConnection, connect

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests/server"))
from harness import children_of, launch_of, shm_segments, stage_processes, wait_gone  # noqa: E402
from live_server import RATE, events_until  # noqa: E402
from serving import Launcher, ServerProcess, free_port, health_status  # noqa: E402

NGINX_TEMPLATE = ROOT / "configs/nginx-replicas.conf"
ORIGIN = "https://voice.example"
NUM_SESSIONS = 6
NUM_LATER_SESSIONS = 3
SPEECH_CONFIG = """\
name: replica-speech
stages:
  - name: speech
    factory: speech_stages:create_fake_speech
    scheduler: ar
    terminal: true
    max_batch_size: 16
    max_step_tokens: 64
    factory_args: {step_delay_ms: 5}
"""


def nginx_binary() -> str | None:
    """$VOICE_SERVER_NGINX, else nginx on PATH or in /usr/sbin (not on every user's PATH)."""
    if "VOICE_SERVER_NGINX" in os.environ:
        return shutil.which(os.environ["VOICE_SERVER_NGINX"])
    return shutil.which("nginx") or shutil.which("nginx", path="/usr/sbin:/usr/local/sbin")


def render_nginx_config(listen: str, replicas: list[str]) -> str:
    """The shipped template with its three placeholders filled (what `envsubst` does in the docs)."""
    values = {"LISTEN": listen, "REPLICA_1": replicas[0], "REPLICA_2": replicas[1]}
    text = NGINX_TEMPLATE.read_text()
    for name, value in values.items():
        assert "${" + name + "}" in text, name
        text = text.replace("${" + name + "}", value)
    assert not re.search(r"\$\{(LISTEN|REPLICA_\d)\}", text)
    return text


class Nginx:
    def __init__(self, binary: str, prefix: Path, replica_ports: list[int]) -> None:
        prefix.mkdir()
        self.prefix, self.port = prefix, free_port()
        (prefix / "nginx.conf").write_text(
            render_nginx_config(f"127.0.0.1:{self.port}", [f"127.0.0.1:{p}" for p in replica_ports]))
        # NOTE: in the foreground (`daemon off`), so the test owns the master process; every path in
        # the config is relative to the prefix, so nothing outside the test's directory is written.
        with open(prefix / "stderr.log", "wb") as stderr:
            self.proc = subprocess.Popen([binary, "-p", f"{prefix}/", "-c", "nginx.conf", "-g", "daemon off;"],
                                         stdout=subprocess.DEVNULL, stderr=stderr)
        deadline = time.monotonic() + 10
        while health_status(self.port) != 200:
            assert self.proc.poll() is None, f"nginx exited: {self.logs()}"
            assert time.monotonic() < deadline, f"nginx not serving /health: {self.logs()}"
            time.sleep(0.05)

    def logs(self) -> str:
        return "\n".join((self.prefix / name).read_text(errors="replace")
                         for name in ("stderr.log", "error.log") if (self.prefix / name).exists())

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()  # NOTE: SIGTERM is nginx's fast shutdown; SIGQUIT would wait for sessions
            self.proc.wait(10)


def active_sessions(port: int) -> int:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as resp:
        text = resp.read().decode()
    return int(sum(s.value for family in text_string_to_metric_families(text) for s in family.samples
                   if s.name == "voice_server_active_sessions"))


def start_session(port: int) -> ClientConnection:
    """A native session opened through nginx as a page on ORIGIN would open it."""
    ws = connect(f"ws://127.0.0.1:{port}/ws", origin=ORIGIN, open_timeout=5)
    ws.send(json.dumps({"type": "session.start", "input_rate": RATE, "output_rate": 24000,
                        "params": {"sampling": {"max_tokens": 12}}}))
    assert json.loads(ws.recv(5))["type"] == "session.started"
    return ws


def talk(ws: ClientConnection, text: str) -> dict[str, object]:
    """One typed turn; the `response_done` event."""
    ws.send(json.dumps({"type": "text", "text": text}))
    events, _ = events_until(ws, "response_done", timeout=20)
    return events[-1]


def open_through(nginx: Nginx, replicas: list[ServerProcess]) -> tuple[ClientConnection, int]:
    """A session opened through nginx, and the index of the replica that holds it (the one whose active
    sessions gauge went up)."""
    before = [active_sessions(r.port) for r in replicas]
    ws = start_session(nginx.port)
    after = [active_sessions(r.port) for r in replicas]
    grown = [i for i, (b, a) in enumerate(zip(before, after, strict=True)) if a == b + 1]
    assert len(grown) == 1 and sum(after) == sum(before) + 1, (before, after)
    return ws, grown[0]


@pytest.fixture
def nginx_path() -> str:
    path = nginx_binary()
    if path is None:  # NOTE: before the replicas start; under `make test` (VOICE_SERVER_NO_SKIP=1) a failure
        pytest.skip("no nginx: apt-get install -y nginx (.ci/run installs it), or set VOICE_SERVER_NGINX")
    return path


@pytest.fixture
def replicas(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[list[ServerProcess]]:
    # NOTE: the stand-in stage's module lives in tests/; stage processes inherit PYTHONPATH.
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(ROOT / "tests"), os.environ.get("PYTHONPATH", "")]))
    run_dir = tmp_path / "run"
    run_dir.mkdir(mode=0o700)
    monkeypatch.setenv("VOICE_SERVER_RUN_DIR", str(run_dir))  # NOTE: a killed replica's leftovers stay here
    config = tmp_path / "speech.yaml"
    config.write_text(SPEECH_CONFIG)
    launcher = Launcher(tmp_path)
    started = [launcher.start("--allowed-origin", ORIGIN, config=config) for _ in range(2)]
    try:
        for server in started:
            server.wait_healthy(90)
        yield started
    finally:
        launcher.close()


def test_sessions_spread_over_replicas_and_survive_the_loss_of_one(
    nginx_path: str, replicas: list[ServerProcess], tmp_path: Path
) -> None:
    nginx = Nginx(nginx_path, tmp_path / "nginx", [r.port for r in replicas])
    sessions: list[tuple[ClientConnection, int]] = []
    killed_launch = ""
    try:
        # The replicas see the browser's Origin through nginx: their allow-list refuses another site.
        with connect(f"ws://127.0.0.1:{nginx.port}/ws", origin="https://evil.example", open_timeout=5) as ws:
            with pytest.raises(ConnectionClosed) as refused:
                ws.recv(5)
            assert refused.value.rcvd is not None and refused.value.rcvd.code == 1008

        # least_conn: sessions opened one after another alternate, N/2 on each replica.
        for _ in range(NUM_SESSIONS):
            sessions.append(open_through(nginx, replicas))
        holders = [index for _, index in sessions]
        assert sorted(holders.count(i) for i in (0, 1)) == [NUM_SESSIONS // 2, NUM_SESSIONS - NUM_SESSIONS // 2]
        for ws, _ in sessions:
            assert talk(ws, "hello")["status"] == "completed"

        # SIGKILL replica 0's whole process tree (server and stage processes) at once.
        victim = replicas[0]
        stages = list(stage_processes(victim.proc.pid).values())
        killed_launch = launch_of(stages[0])
        for pid in [victim.proc.pid, *children_of(victim.proc.pid)]:
            os.kill(pid, signal.SIGKILL)
        victim.proc.wait(10)
        assert wait_gone(stages, 10) == []

        # Its sessions are closed; the survivor's keep talking (the conversation so far included).
        for ws, index in sessions:
            if index == 0:
                with pytest.raises(ConnectionClosed) as closed:
                    while True:
                        ws.recv(10)
                # NOTE: a dead replica sends no close frame: nginx drops the client's connection
                # (1006 at the client), which reconnects and lands on the survivor, as below.
                assert closed.value.rcvd is None
        survivors = [ws for ws, index in sessions if index == 1]
        for ws in survivors:
            done = talk(ws, "are you still there?")
            # NOTE: the stand-in's first word counts the messages it was given: hello, reply, this turn.
            assert done["status"] == "completed" and str(done["text"]).split()[0] == "m3a0", done

        # New sessions through nginx all reach the survivor (the dead one is retried away) and talk.
        for _ in range(NUM_LATER_SESSIONS):
            before = active_sessions(replicas[1].port)
            ws = start_session(nginx.port)
            sessions.append((ws, 1))
            assert active_sessions(replicas[1].port) == before + 1
            assert talk(ws, "a new call")["status"] == "completed"
        assert active_sessions(replicas[1].port) == len(survivors) + NUM_LATER_SESSIONS
        assert health_status(nginx.port) == 200  # NOTE: /health through nginx: the service can take sessions
        assert active_sessions(nginx.port) == active_sessions(replicas[1].port)  # /metrics: the survivor's
    finally:
        for ws, _ in sessions:
            ws.close()
        nginx.close()
        if killed_launch:  # NOTE: a SIGKILLed server cannot remove its own relay slab
            for name in shm_segments(killed_launch):
                os.unlink(f"/dev/shm/{name}")
