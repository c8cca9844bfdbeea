"""SIGTERM to a real `voice-server serve` (the stand-in speech stage) while sessions on all three
endpoints are open and two of them mid-response: every session is closed with 1001, the process
exits 0 (within the stop's 15 s bound), and no stage process or `/dev/shm` segment of the launch is
left behind; the same when the SIGTERM lands while a crashed stage waits for its restart."""

from __future__ import annotations

import json
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from bad_clients import KINDS, start_bad_client
from harness import children_of, launch_of, shm_segments, stage_processes, wait_gone
from live_server import events_until
from realtime_client import RealtimeClient, text_item
from serving import Launcher
from twilio_phone import Phone
from websockets.exceptions import ConnectionClosed
from websockets.sync.client import ClientConnection, connect

TESTS = Path(__file__).resolve().parents[1]
CONFIG = """name: speech-serve
restart_backoff_s: BACKOFF
stages:
  - {name: speech, factory: 'speech_stages:create_fake_speech', scheduler: ar, terminal: true,
     max_batch_size: 8, max_step_tokens: 64, memory_fraction: 0.01, factory_args: {step_delay_ms: 30}}
"""


@pytest.fixture
def launcher(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Launcher]:
    # NOTE: tests/ on the path of the server and its stage processes, for `speech_stages`
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")]))
    launch = Launcher(tmp_path)
    yield launch
    launch.close()


def native(port: int, max_tokens: int) -> ClientConnection:
    ws = connect(f"ws://127.0.0.1:{port}/ws", open_timeout=5)
    ws.send(json.dumps({"type": "session.start", "params": {"sampling": {"max_tokens": max_tokens}}}))
    assert json.loads(ws.recv(5))["type"] == "session.started"
    return ws


def close_code(ws: ClientConnection, timeout: float = 10.0) -> int | None:
    with pytest.raises(ConnectionClosed) as info:
        while True:
            ws.recv(timeout)
    return None if info.value.rcvd is None else info.value.rcvd.code


def test_sigterm_closes_sessions_on_every_endpoint_with_1001_and_leaves_nothing(
    launcher: Launcher, tmp_path: Path
) -> None:
    config = tmp_path / "speech.yaml"
    config.write_text(CONFIG.replace("BACKOFF", "0.5"))
    server = launcher.start(config=config)
    server.wait_healthy()
    children = children_of(server.proc.pid)
    launch = launch_of(stage_processes(server.proc.pid)["speech"])
    assert shm_segments(launch)

    idle, talking = native(server.port, 12), native(server.port, 2000)
    talking.send(json.dumps({"type": "text", "text": "go on forever"}))
    events_until(talking, "response_started")
    realtime = RealtimeClient(server.port)
    realtime.update(max_output_tokens=2000)
    realtime.send("conversation.item.create", item=text_item("tell me a long story"))
    realtime.send("response.create")
    realtime.until("response.output_audio.delta")
    phone = Phone(server.port)
    phone.start()

    assert server.stop(timeout=15) == 0, server.stderr
    assert close_code(idle) == 1001 and close_code(talking) == 1001
    realtime.reader.join(10)
    assert realtime.ws.protocol.close_rcvd is not None and realtime.ws.protocol.close_rcvd.code == 1001
    assert phone.closed_with(10) == 1001
    assert wait_gone(children, 5.0) == []
    assert shm_segments(launch) == []
    assert "Traceback" not in server.stderr, server.stderr


def test_sigterm_while_a_crashed_stage_waits_for_its_restart(launcher: Launcher, tmp_path: Path) -> None:
    config = tmp_path / "speech.yaml"
    config.write_text(CONFIG.replace("BACKOFF", "30"))  # NOTE: the SIGTERM lands inside the backoff
    server = launcher.start(config=config)
    server.wait_healthy()
    stage = stage_processes(server.proc.pid)["speech"]
    launch = launch_of(stage)
    ws = native(server.port, 2000)
    ws.send(json.dumps({"type": "text", "text": "go on forever"}))
    events_until(ws, "response_started")
    os.kill(stage, signal.SIGKILL)
    done = events_until(ws, "response_done")[0][-1]
    assert done["status"] == "failed" and "died" in done["error"], done
    children = children_of(server.proc.pid)
    assert server.stop(timeout=15) == 0, server.stderr
    assert close_code(ws) == 1001
    assert wait_gone(children, 5.0) == []
    assert shm_segments(launch) == []
    assert "Traceback" not in server.stderr, server.stderr


def test_sigterm_with_bad_clients_connected(launcher: Launcher, tmp_path: Path) -> None:
    """A reader that stopped reading cannot take a close frame: it is dropped, and the stop still ends."""
    config = tmp_path / "speech.yaml"
    config.write_text(CONFIG.replace("BACKOFF", "0.5"))
    server = launcher.start(config=config)
    server.wait_healthy()
    launch = launch_of(stage_processes(server.proc.pid)["speech"])
    good = native(server.port, 12)
    bad = [start_bad_client(kind, server.port) for kind in KINDS]
    time.sleep(1.0)  # NOTE: the stalled reader's buffers fill meanwhile
    children = children_of(server.proc.pid)
    started = time.monotonic()
    assert server.stop(timeout=15) == 0, server.stderr
    print(f"SIGTERM with {', '.join(KINDS)} connected: exited in {time.monotonic() - started:.2f} s")
    assert close_code(good) == 1001
    for client in bad:
        client.close()
    assert wait_gone(children, 5.0) == []
    assert shm_segments(launch) == []
    assert "Traceback" not in server.stderr, server.stderr
