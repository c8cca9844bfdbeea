"""The server process never imports torch: `voice-server serve` over the shipped default pipeline
(`configs/default.yaml`, whose stages do run torch in their own processes) starts, serves a session
(input audio through `semantic_vad`, a typed turn answered with text and audio through every stage) and
stops on SIGTERM, and then `torch` is not in the server process's `sys.modules`.

NOTE: torch is ~1 GB of address space and seconds of import per process; the server process handles numpy
only (`voice_server/relay/tensors.py` imports torch lazily for the stage processes). A module imported
anywhere on its path (an endpoint, the coordinator, a config check) that pulled torch in would break that
silently, so the check runs on the real entry: the console script's `main`, in a process of its own.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from harness import children_of, wait_gone
from serving import ROOT, free_port, health_status
from websockets.sync.client import connect

CONFIG = ROOT / "configs" / "default.yaml"
# NOTE: what the `voice-server` console script runs (`sys.exit(main())`), with the module names written
# out at interpreter exit, after the server has served and stopped.
_ENTRY = (
    "import atexit, json, sys\n"
    "from voice_server.cli import main\n"
    "def dump() -> None:\n"
    "    with open(sys.argv[1], 'w') as f:\n"
    "        json.dump(sorted(sys.modules), f)\n"
    "atexit.register(dump)\n"
    "sys.exit(main(sys.argv[2:]))\n"
)


def _typed_turn(port: int) -> list[str]:
    """One `/ws` session: 0.5 s of silence, then a typed question; the event types until `response_done`."""
    with connect(f"ws://127.0.0.1:{port}/ws", open_timeout=5) as ws:
        ws.send(json.dumps({"type": "session.start", "input_rate": 16000, "params": {"sampling": {"max_tokens": 8}}}))
        assert json.loads(ws.recv(10))["type"] == "session.started"
        for _ in range(25):
            ws.send(bytes(640))  # NOTE: 20 ms of 16 kHz PCM16 silence
        ws.send(json.dumps({"type": "text", "text": "Say hello."}))
        kinds: list[str] = []
        num_audio_bytes = 0
        deadline = time.monotonic() + 60
        while "response_done" not in kinds:
            message = ws.recv(max(0.1, deadline - time.monotonic()))
            if isinstance(message, bytes):
                num_audio_bytes += len(message)
            else:
                kinds.append(json.loads(message)["type"])
        assert num_audio_bytes > 0, kinds
        return kinds


def test_the_server_process_never_imports_torch(tmp_path: Path) -> None:
    port, modules_path, stderr_path = free_port(), tmp_path / "modules.json", tmp_path / "stderr.log"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    with open(stderr_path, "wb") as stderr:
        proc = subprocess.Popen(
            [sys.executable, "-c", _ENTRY, str(modules_path), "serve", "--config", str(CONFIG), "--host", "127.0.0.1",
             "--port", str(port), "--log-level", "warning"],
            cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=stderr,
        )
    try:
        deadline = time.monotonic() + 180
        while health_status(port) != 200:
            assert proc.poll() is None, f"server exited with {proc.returncode}:\n{stderr_path.read_text()}"
            assert time.monotonic() < deadline, f"server not healthy:\n{stderr_path.read_text()}"
            time.sleep(0.1)
        kinds = _typed_turn(port)
        assert "response_started" in kinds and "text_delta" in kinds, kinds
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0, stderr_path.read_text()
    finally:
        if proc.poll() is None:
            children = children_of(proc.pid)
            proc.kill()
            proc.wait()
            for pid in wait_gone(children, 5.0):
                os.kill(pid, signal.SIGKILL)
    modules = set(json.loads(modules_path.read_text()))
    # NOTE: proof the dump is the server's: it imported the app and the endpoints.
    assert {"voice_server.server.app", "voice_server.session.native", "voice_server.engine.coordinator"} <= modules
    assert not {m for m in modules if m == "torch" or m.startswith("torch.")}, "the server process imported torch"
