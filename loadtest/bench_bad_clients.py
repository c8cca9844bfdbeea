"""First-audio latency of 4 good voice sessions alone vs beside slow and broken clients, in one run.

Starts `voice-server serve` (a real process; `configs/default.yaml` by default, or the test stand-in
speech stage with `--stand-in`), then alternates blocks of the two conditions:
- `alone`: 4 good `WS /ws` sessions, each taking typed turns (the questions below) back to back;
- `bad clients`: the same, while a thread keeps one of each bad client of `tests/load/bad_clients.py`
  running (a reader that stopped reading while its microphone streams on, half a frame then a hang,
  half a frame then a cut TCP connection, a disconnect mid-response without a close frame), each
  replaced by a fresh one after `--bad-life-s`: every bad client starts a response the pipeline
  computes, so this is the load they put on the server;
- `polite clients` (the control): as many well-behaved extra sessions on the same cadence, each taking
  one turn, reading its reply and closing properly: the same work without the misbehaviour. `bad
  clients` near `polite clients` means the misbehaviour costs the good sessions nothing beyond the
  work the extra sessions ask for.
Measured per good turn, at the client: the turn sent -> the first reply audio byte received.
Printed: p50/p90 per condition, their ratio to `alone`, failed good turns, bad clients started, and the
server's active sessions gauge once the bad clients are gone (every one freed: 0).

Usage: OMP_NUM_THREADS=1 python loadtest/bench_bad_clients.py [--turns 20] [--blocks 2] [--stand-in]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import threading
import time
import urllib.request
import warnings
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(1, str(ROOT / "tests" / "load"))
from bad_clients import KINDS, RawSession, start_bad_client  # noqa: E402
from bench_sessions import pct, start_server  # noqa: E402
from table import cpu_description, format_table  # noqa: E402
from websockets.sync.client import ClientConnection, connect  # noqa: E402

NUM_GOOD = 4
QUESTIONS = ("What is the capital of France?", "How many legs does a spider have?", "What color is the sky?",
             "What is two plus two?", "Can you name a big animal?")
STAND_IN = """name: speech-stand-in
stages:
  - {name: speech, factory: 'speech_stages:create_fake_speech', scheduler: ar, terminal: true,
     max_batch_size: 8, max_step_tokens: 64, memory_fraction: 0.01, factory_args: {step_delay_ms: 30}}
"""


def good_session(port: int, max_tokens: int = 24) -> ClientConnection:
    ws = connect(f"ws://127.0.0.1:{port}/ws", open_timeout=10, max_size=None)
    ws.send(json.dumps({"type": "session.start", "input_rate": 16000, "output_rate": 24000,
                        "params": {"sampling": {"max_tokens": max_tokens}}}))
    assert json.loads(ws.recv(10))["type"] == "session.started"
    return ws


def turn(ws: ClientConnection, text: str) -> tuple[str, float | None]:
    """(status, seconds from the turn sent to the first audio byte received)."""
    sent, first = time.monotonic(), None
    ws.send(json.dumps({"type": "text", "text": text}))
    while True:
        message = ws.recv(60)
        if isinstance(message, bytes):
            first = first or time.monotonic() - sent
        elif (event := json.loads(message))["type"] == "response_done":
            return event["status"], first


def run_good(port: int, num_turns: int) -> tuple[list[float], int]:
    """4 sessions take `num_turns` turns in all; (first-audio seconds of completed turns, failures)."""
    latencies: list[float] = []
    failures = [0]
    lock = threading.Lock()

    def one(i: int) -> None:
        ws = good_session(port)
        for k in range(i, num_turns, NUM_GOOD):
            status, first = turn(ws, QUESTIONS[k % len(QUESTIONS)])
            with lock:
                if status == "completed" and first is not None:
                    latencies.append(first)
                else:
                    failures[0] += 1
        ws.close()

    threads = [threading.Thread(target=one, args=(i,)) for i in range(NUM_GOOD)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(600)
    return latencies, failures[0]


class PoliteClient:
    """An extra session that takes one turn, reads its whole reply and closes with a close frame."""

    def __init__(self, port: int) -> None:
        self.ws = good_session(port, max_tokens=400)  # NOTE: what a bad client asks for
        self.thread = threading.Thread(target=turn, args=(self.ws, "talk for a long time"), daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.thread.join(30)
        self.ws.close()


class BadClients:
    """Keeps one bad client of each kind (or, `polite`, one well-behaved one per kind) running until `stop`."""

    def __init__(self, port: int, life_s: float, polite: bool = False) -> None:
        self.port, self.life_s, self.polite = port, life_s, polite
        self.num_started, self.errors = 0, []  # type: tuple[int, list[str]]
        self._stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        live: dict[str, tuple[RawSession | PoliteClient, float]] = {}
        while not self._stop.is_set():
            for kind in KINDS:
                client, since = live.get(kind, (None, 0.0))
                if client is not None and time.monotonic() - since < self.life_s:
                    continue
                if client is not None:
                    client.close()
                try:
                    client = PoliteClient(self.port) if self.polite else start_bad_client(kind, self.port)
                    live[kind] = (client, time.monotonic())
                    self.num_started += 1
                except (OSError, AssertionError) as exc:  # NOTE: reported, the run goes on
                    self.errors.append(f"{kind}: {exc}")
                    live.pop(kind, None)
            self._stop.wait(0.05)
        for client, _ in live.values():
            client.close()

    def stop(self) -> None:
        self._stop.set()
        self.thread.join(30)


def active_sessions(port: int) -> float:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as resp:
        for line in resp.read().decode().splitlines():
            if line.startswith("voice_server_active_sessions{") and 'endpoint="native"' in line:
                return float(line.rsplit(" ", 1)[1])
    return 0.0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default=str(ROOT / "configs" / "default.yaml"))
    parser.add_argument("--stand-in", action="store_true", help="the test stand-in speech stage (no model)")
    parser.add_argument("--turns", type=int, default=20, help="good turns per block")
    parser.add_argument("--blocks", type=int, default=2, help="blocks of each condition, alternating")
    parser.add_argument("--bad-life-s", type=float, default=2.0)
    args = parser.parse_args()
    warnings.filterwarnings("ignore", category=DeprecationWarning)  # NOTE: websockets' sync connect without `with`
    config = Path(args.config)
    if args.stand_in:
        config = Path(tempfile.mkdtemp()) / "stand-in.yaml"
        config.write_text(STAND_IN)
        os.environ["PYTHONPATH"] = os.pathsep.join([str(ROOT / "tests"), os.environ.get("PYTHONPATH", "")])
    proc, port = start_server(config)
    try:
        run_good(port, NUM_GOOD)  # NOTE: warm-up
        results: dict[str, list[float]] = {"alone": [], "bad clients": [], "polite clients": []}
        failures = dict.fromkeys(results, 0)
        num_bad, bad_errors = 0, []
        for _ in range(args.blocks):
            for condition in results:
                bad = None if condition == "alone" else BadClients(port, args.bad_life_s, condition == "polite clients")
                latencies, failed = run_good(port, args.turns)
                if bad is not None:
                    bad.stop()
                    num_bad += bad.num_started if not bad.polite else 0
                    bad_errors += bad.errors
                results[condition] += latencies
                failures[condition] += failed
        deadline = time.monotonic() + 30
        while (left := active_sessions(port)) and time.monotonic() < deadline:
            time.sleep(0.2)
    finally:
        proc.terminate()
        proc.wait(30)
    base = results["alone"]
    rows: list[dict[str, Any]] = []
    for condition, values in results.items():
        p50, p90 = 1000 * pct(values, 0.5), 1000 * pct(values, 0.9)
        rows.append({"condition": condition, "good turns": len(values), "failed": failures[condition],
                     "first audio p50 ms": p50, "p90 ms": p90, "p50 / alone": p50 / (1000 * pct(base, 0.5)),
                     "p90 / alone": p90 / (1000 * pct(base, 0.9))})
    print(cpu_description())
    print(f"config: {'the stand-in speech stage' if args.stand_in else config.name}; {NUM_GOOD} good sessions; "
          f"{args.blocks} blocks of {args.turns} turns per condition; bad clients: {', '.join(KINDS)} "
          f"(each replaced after {args.bad_life_s:g} s; {num_bad} started)")
    print(format_table(rows))
    print(f"active sessions once the bad clients were gone: {left:g}; bad client errors: {bad_errors or 'none'}")


if __name__ == "__main__":
    main()
