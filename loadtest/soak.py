"""Soak: N sessions talk to a real `voice-server serve` for a long while; memory, descriptors and shared
memory segments of every process must stay flat after warm-up.

Starts `voice-server serve` (default `configs/default.yaml`), then `--sessions` clients over `WS /ws`,
each speaking questions synthesised by hibari-tts at real-time pace (16 kHz, silence streaming on while
the reply plays, as from a microphone), awaiting each reply, and reconnecting every `--turns-per-session`
turns (so session set-up and tear-down are soaked too). Every `--sample-s` seconds `soak_probe` reads
the RSS and open descriptors of the server and each stage process (/proc) and the /dev/shm segments
they map. At the end: a table (start, after warm-up, end, max, slope per minute) and a verdict against
the tolerances in `soak_probe` (private memory, RssAnon, may grow by max(5%, 20 MB) per process after
warm-up; descriptors within +-4; segments within +-2; VmRSS and RssShmem are reported, not judged: the
relay slabs' shared pages count in VmRSS as they are first touched). The verdict also fails when a
session gets an error, a turn does not complete, or the server logs a traceback.

Usage: OMP_NUM_THREADS=1 python loadtest/soak.py [--duration 600] [--sessions 8] [--config ...]
       (`make soak`; the short version runs in `make test`: tests/load/test_soak_short.py)
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_sessions import start_server  # noqa: E402
from bench_turns import FRAME, QUESTIONS, RATE, synthesize  # noqa: E402
from soak_probe import Probe, summarize  # noqa: E402
from table import cpu_description, format_table  # noqa: E402
from websockets.sync.client import connect  # noqa: E402

from voice_server.audio import float32_to_pcm16, pcm16_to_bytes  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
TURN_TIMEOUT_S = 90.0


@dataclass
class Talker:
    """One client: speaks, streams silence until `response_done`, speaks again; reconnects every few turns."""

    port: int
    speech: list[np.ndarray]
    offset: int
    turns_per_session: int
    silence_ms: int
    stop: threading.Event
    statuses: dict[str, int] = field(default_factory=dict)
    errors: list[str] = field(default_factory=list)
    num_sessions: int = 0

    def run(self) -> None:
        turn = self.offset
        while not self.stop.is_set():
            try:
                turn = self._session(turn)
            except Exception as exc:  # NOTE: reported in the verdict, the other talkers go on
                self.errors.append(f"{type(exc).__name__}: {exc}")
                time.sleep(1.0)

    def _session(self, turn: int) -> int:
        with connect(f"ws://127.0.0.1:{self.port}/ws", open_timeout=30, max_size=None) as ws:
            ws.send(json.dumps({"type": "session.start", "input_rate": RATE, "output_rate": 24000,
                                "turn_detection": {"silence_duration_ms": self.silence_ms}}))
            started = json.loads(ws.recv(30))
            if started.get("type") != "session.started":
                raise RuntimeError(f"session.start answered {started}")
            self.num_sessions += 1
            done: dict[str, Any] = {"event": threading.Event()}
            reader = threading.Thread(target=self._read, args=(ws, done), daemon=True)
            reader.start()
            for _ in range(self.turns_per_session):
                if self.stop.is_set():
                    break
                self._turn(ws, self.speech[turn % len(self.speech)], done)
                turn += 1
        reader.join(5)
        return turn

    def _turn(self, ws: Any, audio: np.ndarray, done: dict[str, Any]) -> None:
        done["event"].clear()
        silence = np.zeros(FRAME, np.int16)
        pcm = float32_to_pcm16(audio)
        frames = [silence] * 10 + [pcm[i:i + FRAME] for i in range(0, len(pcm), FRAME)]
        start, sent = time.monotonic(), 0
        while sent < len(frames) or not done["event"].is_set():
            ws.send(pcm16_to_bytes(frames[sent] if sent < len(frames) else silence))
            sent += 1
            delay = start + sent * FRAME / RATE - time.monotonic()
            if delay > 0:
                time.sleep(delay)
            if time.monotonic() - start > TURN_TIMEOUT_S:
                raise TimeoutError(f"no response_done within {TURN_TIMEOUT_S:.0f} s")
        status = done["status"]
        self.statuses[status] = self.statuses.get(status, 0) + 1

    def _read(self, ws: Any, done: dict[str, Any]) -> None:
        while True:
            try:
                message = ws.recv(300)
            except Exception:
                return
            if isinstance(message, bytes):
                continue
            event = json.loads(message)
            if event["type"] == "error":
                self.errors.append(f"error event: {event}")
            elif event["type"] == "response_done":
                done["status"] = event["status"]
                done["event"].set()


def soak(config: Path, duration_s: float, num_sessions: int, warmup_s: float, sample_s: float,
         turns_per_session: int = 10, silence_ms: int = 500) -> dict[str, Any]:
    """Run the soak; returns the table rows, the problems (empty: pass) and the session counts."""
    speech = synthesize(QUESTIONS)
    log_path = Path(tempfile.mkdtemp(prefix="soak-")) / "server.log"
    proc, port = start_server(config, log_path)
    stop = threading.Event()
    talkers = [Talker(port, speech, i, turns_per_session, silence_ms, stop) for i in range(num_sessions)]
    probe = Probe(proc.pid)
    threads = [threading.Thread(target=t.run, daemon=True) for t in talkers]
    try:
        probe.sample()
        for i, thread in enumerate(threads):
            thread.start()
            time.sleep(0.37 * (i % 3))  # NOTE: staggered, so turns do not all end at once
        deadline = time.monotonic() + duration_s
        while time.monotonic() < deadline:
            time.sleep(min(sample_s, max(0.0, deadline - time.monotonic())))
            probe.sample()
            if proc.poll() is not None:
                break
    finally:
        stop.set()
        for thread in threads:
            thread.join(TURN_TIMEOUT_S + 10)
        is_alive = proc.poll() is None
        proc.terminate()
        proc.wait(60)
    rows, problems = summarize(probe, warmup_s)
    if not is_alive:
        problems.append(f"the server exited during the run ({proc.returncode})")
    log = log_path.read_text(errors="replace")
    if "Traceback" in log:
        problems.append(f"the server log has a traceback: {log[log.index('Traceback'):][:600]}")
    statuses: dict[str, int] = {}
    for talker in talkers:
        for status, count in talker.statuses.items():
            statuses[status] = statuses.get(status, 0) + count
        problems += [f"talker {talker.offset}: {e}" for e in talker.errors[:3]]
    if statuses.get("completed", 0) == 0 or set(statuses) != {"completed"}:
        problems.append(f"turns did not all complete: {statuses}")
    return {"rows": rows, "problems": problems, "statuses": statuses,
            "sessions": sum(t.num_sessions for t in talkers), "log_path": str(log_path),
            "series": {f"{metric} {name}": points for (metric, name), points in probe.series.items()}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default=str(ROOT / "configs" / "default.yaml"))
    parser.add_argument("--duration", type=float, default=600.0, help="seconds of talking")
    parser.add_argument("--sessions", type=int, default=8)
    parser.add_argument("--warmup", type=float, default=None, help="seconds (default: 20%% of the duration)")
    parser.add_argument("--sample-s", type=float, default=5.0)
    parser.add_argument("--turns-per-session", type=int, default=10, help="turns before a client reconnects")
    parser.add_argument("--series", default="", help="also write every sample to this JSON file")
    args = parser.parse_args()
    warmup = args.warmup if args.warmup is not None else 0.2 * args.duration
    print(cpu_description())
    load_before = os.getloadavg()
    started = time.monotonic()
    result = soak(Path(args.config), args.duration, args.sessions, warmup, args.sample_s, args.turns_per_session)
    if args.series:
        Path(args.series).write_text(json.dumps(result["series"]))
    print(f"\n== Soak: {args.sessions} sessions over WS /ws, {Path(args.config).name}, {args.duration:.0f} s "
          f"(warm-up {warmup:.0f} s, a sample every {args.sample_s:g} s) ==")
    print(format_table(result["rows"]))
    print(f"\nTurns: {result['statuses']}; sessions opened: {result['sessions']}; "
          f"wall {time.monotonic() - started:.0f} s; load average before {load_before[0]:.2f}, "
          f"after {os.getloadavg()[0]:.2f} (the machine is shared)")
    print("Tolerance: private memory (RssAnon) growth after warm-up <= max(5%, 20 MB) per process; fds +-4; "
          "/dev/shm segments +-2 (VmRSS and RssShmem are reported, not judged: soak_probe says why)")
    for problem in result["problems"]:
        print(f"problem: {problem}")
    print(f"Verdict: {'PASS' if not result['problems'] else 'FAIL'}")
    print("\n" + cpu_description())
    sys.exit(0 if not result["problems"] else 1)


if __name__ == "__main__":
    main()
