"""First-audio latency of voice sessions over `WS /ws`, at 1, 4 and 8 concurrent sessions.

Starts `voice-server serve` (a real process) on a pipeline config, then N clients at once: each
streams a spoken turn (speech-like audio, `voice_server.audio.synthetic`) at real-time pace, waits for
the reply, and measures, at the client:
- `first_audio_ms`: the server's `speech_stopped` event (its VAD decided the turn ended) -> the first
  *audible* reply audio as the client plays it (the first 10 ms frame at -40 dBFS or more,
  `PlayoutClock`); `first_byte_ms` beside it: to the first byte of reply audio; the server-side
  breakdown comes from the response's `timings_ms` (each stage's first output after the request was
  submitted);
- `from_speech_end_ms`: the last voiced sample sent -> the first audible reply audio (adds the end-of-turn
  wait, server_vad's `silence_duration_ms` window, 500 ms by default: what a user waits).
Goal (issue): p90 at 8 sessions no more than 2x p50 at 1 session.

Usage: OMP_NUM_THREADS=1 python loadtest/bench_sessions.py [--config configs/qwen3-omni-tiny.yaml] [--rounds 3]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import socket
import statistics
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from table import cpu_description, format_table  # noqa: E402
from websockets.sync.client import connect  # noqa: E402

from voice_server.audio import PlayoutClock, float32_to_pcm16, pcm16_from_bytes, pcm16_to_bytes  # noqa: E402
from voice_server.audio.synthetic import signal_of  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
RATE = 16000
SPEECH_MS, TAIL_MS, LEAD_MS = 900, 800, 200
PARAMS = {"sampling": {"max_tokens": 16, "ignore_eos": True}, "talker": {"max_frames": 24}}
STAGES = ("encoder", "thinker", "talker", "code2wav", "first_audio_sent", "first_audible")


def start_server(config: Path, log_path: Path | None = None) -> tuple[subprocess.Popen[bytes], int]:
    """`voice-server serve` on a free port of 127.0.0.1, once healthy; its log (stderr) to `log_path`
    if given (the benchmarks' own terminal otherwise)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = int(s.getsockname()[1])
    with open(log_path, "wb") if log_path is not None else contextlib.nullcontext() as log:
        proc = subprocess.Popen([sys.executable, "-m", "voice_server.cli", "serve", "--config", str(config),
                                 "--host", "127.0.0.1", "--port", str(port), "--log-level", "warning"],
                                cwd=ROOT, env=dict(os.environ), stdout=subprocess.DEVNULL, stderr=log)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as resp:
                if resp.status == 200:
                    return proc, port
        except OSError:
            pass
        time.sleep(0.2)
    proc.kill()
    tail = log_path.read_text(errors="replace")[-2000:] if log_path is not None else ""
    raise RuntimeError(f"the server did not become healthy {tail}")


def one_turn(port: int, seed: int) -> dict[str, Any]:
    """One session, one spoken turn at real-time pace; latencies in ms."""
    signal = signal_of(RATE, ("noise", LEAD_MS), ("voice", SPEECH_MS), ("noise", TAIL_MS))
    pcm = float32_to_pcm16(signal)
    step = RATE // 50  # 20 ms frames
    with connect(f"ws://127.0.0.1:{port}/ws", open_timeout=10, max_size=None) as ws:
        ws.send(json.dumps({"type": "session.start", "input_rate": RATE, "output_rate": 24000, "params": PARAMS}))
        json.loads(ws.recv(10))
        times: dict[str, float] = {}
        done: dict[str, Any] = {}
        heard = PlayoutClock(24000)

        def read() -> None:
            while "done" not in times:
                message = ws.recv(60)
                now = time.monotonic()
                if isinstance(message, bytes):
                    heard.sent(pcm16_from_bytes(message), now)
                    continue
                event = json.loads(message)
                if event["type"] == "speech_stopped":
                    times["speech_stopped"] = now
                elif event["type"] == "response_done":
                    times["done"] = now
                    done.update(event)

        reader = threading.Thread(target=read, daemon=True)
        reader.start()
        start = time.monotonic()
        speech_end_at = start + (LEAD_MS + SPEECH_MS) / 1000
        for i in range(0, len(pcm), step):
            ws.send(pcm16_to_bytes(pcm[i:i + step]))
            delay = start + (i + step) / RATE - time.monotonic()
            if delay > 0:
                time.sleep(delay)
        reader.join(60)
    if done.get("status") != "completed" or heard.first_audible_at is None or heard.first_byte_at is None:
        raise RuntimeError(f"turn failed: {done}")
    return {"first_audio_ms": 1000 * (heard.first_audible_at - times["speech_stopped"]),
            "first_byte_ms": 1000 * (heard.first_byte_at - times["speech_stopped"]),
            "from_speech_end_ms": 1000 * (heard.first_audible_at - speech_end_at),
            "timings": done.get("timings_ms", {})}


def run_level(port: int, num_sessions: int, rounds: int) -> list[dict[str, Any]]:
    results: list[dict[str, Any]] = []
    lock = threading.Lock()
    for r in range(rounds):
        def worker(i: int, r: int = r) -> None:
            out = one_turn(port, seed=100 * r + i)
            with lock:
                results.append(out)
        threads = [threading.Thread(target=worker, args=(i,)) for i in range(num_sessions)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
    return results


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default=str(ROOT / "configs" / "qwen3-omni-tiny.yaml"))
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--levels", default="1,4,8")
    args = parser.parse_args()
    print(cpu_description())
    proc, port = start_server(Path(args.config))
    rows, stage_rows = [], []
    try:
        one_turn(port, seed=0)  # warm-up
        for level in (int(x) for x in args.levels.split(",")):
            res = run_level(port, level, args.rounds)
            first = [r["first_audio_ms"] for r in res]
            spoken = [r["from_speech_end_ms"] for r in res]
            rows.append({"sessions": level, "turns": len(res), "first_audio_p50_ms": pct(first, 0.5),
                         "first_audio_p90_ms": pct(first, 0.9),
                         "first_byte_p50_ms": pct([r["first_byte_ms"] for r in res], 0.5),
                         "from_speech_end_p50_ms": pct(spoken, 0.5),
                         "from_speech_end_p90_ms": pct(spoken, 0.9)})
            stage_rows.append({"sessions": level, **{f"{s}_ms": statistics.median(
                r["timings"].get(s, float("nan")) for r in res) for s in STAGES}})
    finally:
        proc.terminate()
        proc.wait(30)
    print(f"\n== First audio over WS /ws, {Path(args.config).name}, {args.rounds} rounds per level ==")
    print(format_table(rows))
    print("\n== Per-stage first output after submit, ms (median) ==")
    print(format_table(stage_rows))
    base = rows[0]["first_audio_p50_ms"]
    top = rows[-1]
    print(f"\nGoal: p90 at {top['sessions']} sessions <= 2x p50 at 1: {top['first_audio_p90_ms']:.1f} ms vs "
          f"{2 * base:.1f} ms -> {'met' if top['first_audio_p90_ms'] <= 2 * base else 'not met'} "
          f"(ratio {top['first_audio_p90_ms'] / base:.2f})")
    print("\n" + cpu_description())


if __name__ == "__main__":
    main()
