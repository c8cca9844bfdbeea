"""Spoken turns on the embedded CPU default (`configs/default.yaml`): first-audio latency at 1, 4 and 8
concurrent sessions, per-stage breakdown, and the thinker's decode speed.

Starts `voice-server serve` (a real process), then N clients over `WS /ws`. Each session asks the
questions below in turn (speech synthesised once with hibari-tts, streamed at real-time pace at 16 kHz
with silence around it, the silence streaming on until the reply is done), so later turns carry the
conversation so far. Measured per turn:
- `eot`: the server's end-of-turn decision -> the first *audible* reply audio (`timings_ms.first_audible`
  of `response_done`: the first 10 ms frame at -40 dBFS or more, on the client's playout clock);
  `eot_byte`: the same to the first audio byte sent (`first_audio_sent`);
- `spoken`: the last voiced sample the client sent -> the first audible reply frame as the client plays
  what it received (`PlayoutClock` over the arrival times): what a person waits, the end-of-turn
  silence (server_vad's `silence_duration_ms`, or semantic_vad's wait) included; `spoken_byte`: to the
  first reply byte received;
- per stage (ms after the end-of-turn decision, medians): `transcript` final, `thinker` first token,
  `talker` first audio;
- thinker decode: tokens per second of each reply (its text deltas, first to last), and the aggregate
  over all replies of a level (all tokens / the time any reply was decoding).
Goals, 2-core machine: eot p50 <= 300 ms at 1 session, eot p90 <= 800 ms at 4 (issue #10); eot p90 at
8 sessions no more than 2x p50 at 1 (issue #9). Sessions start 0-0.74 s apart and ask questions of
different lengths, so their turns end at different moments, as real users' do.

Usage: OMP_NUM_THREADS=1 python loadtest/bench_turns.py [--turns 20] [--levels 1,4,8]
       [--turn-detection semantic_vad|server_vad] [--silence-ms 500 (server_vad)]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_sessions import pct, start_server  # noqa: E402
from soak_probe import label, memory_mb, process_tree  # noqa: E402
from table import cpu_description, format_table  # noqa: E402
from websockets.sync.client import connect  # noqa: E402

from voice_server.audio import (  # noqa: E402
    PlayoutClock,
    StreamResampler,
    float32_to_pcm16,
    pcm16_from_bytes,
    pcm16_to_bytes,
)

ROOT = Path(__file__).resolve().parents[1]
RATE = 16000
FRAME = RATE // 50  # 20 ms
QUESTIONS = ("What is the capital of France?", "How many legs does a spider have?", "What color is the sky?",
             "What is two plus two?", "Can you name a big animal?")
STAGES = ("transcript", "thinker", "talker", "first_audio_sent", "first_audible")
OUTPUT_RATE = 24000


def synthesize(texts: tuple[str, ...]) -> list[np.ndarray]:
    """Each text spoken by hibari-tts (its bundled voice), at 16 kHz float32."""
    from hibari import Hibari

    tts = Hibari()  # NOTE: the bundled default voice; other voices would download
    out = []
    for text in texts:
        audio = StreamResampler(24000, RATE).process(np.asarray(tts(text, seed=0), dtype=np.float32).reshape(-1))
        # NOTE: cut the synthesiser's own leading and trailing quiet (below -50 dBFS), so the last sample
        # sent is the last voiced one: `spoken` then counts from where a listener hears the voice stop.
        voiced = np.flatnonzero(np.abs(audio) > 10 ** (-50 / 20))
        out.append(audio[voiced[0]:voiced[-1] + 1])
    return out


class Turns:
    """One session's client: speaks each question, reads events on its own thread."""

    def __init__(self, port: int, speech: list[np.ndarray], num_turns: int, turns: dict[str, Any], offset: int) -> None:
        self.port, self.speech, self.num_turns = port, speech, num_turns
        self.turns, self.offset = turns, offset
        self.results: list[dict[str, Any]] = []
        self.error = ""

    def run(self) -> None:
        try:
            self._run()
        except Exception as exc:  # NOTE: reported in the table's notes, not a crash of the whole run
            self.error = f"{type(exc).__name__}: {exc}"

    def _run(self) -> None:
        with connect(f"ws://127.0.0.1:{self.port}/ws", open_timeout=10, max_size=None) as ws:
            ws.send(json.dumps({"type": "session.start", "input_rate": RATE, "output_rate": OUTPUT_RATE,
                                "turn_detection": self.turns}))
            json.loads(ws.recv(10))
            state: dict[str, Any] = {"turn": None}
            reader = threading.Thread(target=self._read, args=(ws, state), daemon=True)
            reader.start()
            silence = np.zeros(FRAME, np.int16)
            for k in range(self.num_turns):
                turn: dict[str, Any] = {"deltas": [], "done": threading.Event(), "playout": PlayoutClock(OUTPUT_RATE)}
                state["turn"] = turn
                pcm = float32_to_pcm16(self.speech[(self.offset + k) % len(self.speech)])
                frames = [silence] * 10 + [pcm[i:i + FRAME] for i in range(0, len(pcm), FRAME)]
                start = time.monotonic()
                for i, frame in enumerate(frames):
                    ws.send(pcm16_to_bytes(frame))
                    if i == len(frames) - 1:
                        turn["voice_end"] = time.monotonic()
                    _pace(start, i + 1)
                sent = len(frames)
                while not turn["done"].is_set():  # NOTE: silence goes on, as from a real microphone
                    ws.send(pcm16_to_bytes(silence))
                    sent += 1
                    _pace(start, sent)
                    if time.monotonic() - start > 60:
                        raise TimeoutError("no response_done within 60 s")
                playout = turn["playout"]
                turn["first_audio"], turn["first_byte"] = playout.first_audible_at, playout.first_byte_at
                if turn["status"] != "completed" or turn["first_audio"] is None:
                    raise RuntimeError(f"turn {k}: {turn.get('status')} {turn.get('error', '')}")
                self.results.append(turn)

    def _read(self, ws: Any, state: dict[str, Any]) -> None:
        while True:
            try:
                message = ws.recv(120)
            except Exception:
                return
            now, turn = time.monotonic(), state["turn"]
            if turn is None:
                continue
            if isinstance(message, bytes):
                turn["playout"].sent(pcm16_from_bytes(message), now)
                continue
            event = json.loads(message)
            if event["type"] == "input_transcript_done":
                turn["transcript"] = event["transcript"]
            elif event["type"] == "text_delta":
                turn["deltas"].append(now)
            elif event["type"] == "response_done":
                turn.update(status=event["status"], error=event.get("error", ""), text=event["text"],
                            timings=event.get("timings_ms", {}), end=now)
                turn["done"].set()


def _pace(start: float, num_frames: int) -> None:
    delay = start + num_frames * FRAME / RATE - time.monotonic()
    if delay > 0:
        time.sleep(delay)


def run_level(port: int, speech: list[np.ndarray], num_sessions: int, min_turns: int,
              turns: dict[str, Any]) -> tuple[list[dict[str, Any]], list[str]]:
    per_session = -(-min_turns // num_sessions)
    clients = [Turns(port, speech, per_session, turns, offset=i) for i in range(num_sessions)]
    threads = [threading.Thread(target=c.run) for c in clients]
    for i, t in enumerate(threads):
        t.start()
        time.sleep(0.37 * (i % 3))  # NOTE: staggered starts: sessions do not all end turns at once
    for t in threads:
        t.join(600)
    return [r for c in clients for r in c.results], [c.error for c in clients if c.error]


def decode_rates(turns: list[dict[str, Any]]) -> tuple[float, float]:
    """Median per-reply tokens/s, and all tokens / the union of the decoding intervals."""
    spans = [(t["deltas"][0], t["deltas"][-1], len(t["deltas"])) for t in turns if len(t["deltas"]) > 2]
    if not spans:
        return float("nan"), float("nan")
    single = statistics.median((n - 1) / (b - a) for a, b, n in spans if b > a)
    busy, end = 0.0, float("-inf")
    for a, b, _ in sorted(spans):
        busy += max(0.0, b - max(a, end))
        end = max(end, b)
    return single, sum(n - 1 for _, _, n in spans) / busy if busy else float("nan")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default=str(ROOT / "configs" / "default.yaml"))
    parser.add_argument("--turns", type=int, default=20, help="turns per level, at least")
    parser.add_argument("--levels", default="1,4,8")
    parser.add_argument("--turn-detection", default="semantic_vad", choices=("semantic_vad", "server_vad"))
    parser.add_argument("--silence-ms", type=int, default=500, help="server_vad's silence window")
    args = parser.parse_args()
    turns_config: dict[str, Any] = {"type": args.turn_detection}
    if args.turn_detection == "server_vad":
        turns_config["silence_duration_ms"] = args.silence_ms
    print(cpu_description())
    speech = synthesize(QUESTIONS)
    start = time.monotonic()
    proc, port = start_server(Path(args.config))
    startup_s = time.monotonic() - start
    rows, stage_rows, notes, sample = [], [], [], ""
    try:
        run_level(port, speech, 1, 2, turns_config)  # NOTE: warm-up (first-call paths, caches)
        memory = {label(pid, proc.pid): m["rss_mb"] for pid in process_tree(proc.pid)
                  if (m := memory_mb(pid)) is not None}
        for level in (int(x) for x in args.levels.split(",")):
            turns, errors = run_level(port, speech, level, args.turns, turns_config)
            notes += [f"{level} sessions: {e}" for e in errors]
            if not turns:
                continue
            eot = [t["timings"]["first_audible"] for t in turns if "first_audible" in t["timings"]]
            eot_byte = [t["timings"]["first_audio_sent"] for t in turns if "first_audio_sent" in t["timings"]]
            spoken = [1000 * (t["first_audio"] - t["voice_end"]) for t in turns]
            spoken_byte = [1000 * (t["first_byte"] - t["voice_end"]) for t in turns]
            single, aggregate = decode_rates(turns)
            rows.append({"sessions": level, "turns": len(turns), "eot_p50_ms": pct(eot, 0.5),
                         "eot_p90_ms": pct(eot, 0.9), "eot_byte_p50_ms": pct(eot_byte, 0.5),
                         "spoken_p50_ms": pct(spoken, 0.5), "spoken_p90_ms": pct(spoken, 0.9),
                         "spoken_byte_p50_ms": pct(spoken_byte, 0.5), "decode_tok_s": single,
                         "aggregate_tok_s": aggregate})
            stage_rows.append({"sessions": level, **{f"{s}_ms": statistics.median(
                t["timings"].get(s, float("nan")) for t in turns) for s in STAGES}})
            sample = sample or f"{turns[0].get('transcript', '?')!r} -> {turns[0]['text']!r}"
    finally:
        proc.terminate()
        proc.wait(30)
    how = f"server_vad, silence window {args.silence_ms} ms" if args.turn_detection == "server_vad" else "semantic_vad"
    print(f"\n== Spoken turns over WS /ws, {Path(args.config).name}, {how} ==")
    print(format_table(rows))
    print("\n== Per stage, ms after the end-of-turn decision (median) ==")
    print(format_table(stage_rows))
    print(f"\nSample turn: {sample}")
    print(f"Start-up: serve -> /health 200 in {startup_s:.1f} s; resident memory after the warm-up (VmRSS): "
          + ", ".join(f"{name} {mb:.0f} MB" for name, mb in memory.items()))
    for note in notes:
        print(f"error: {note}")
    by_level = {r["sessions"]: r for r in rows}
    if 1 in by_level and 4 in by_level:
        p50, p90 = by_level[1]["eot_p50_ms"], by_level[4]["eot_p90_ms"]
        print(f"Goal: eot p50 at 1 session <= 300 ms: {p50:.0f} ms ({'met' if p50 <= 300 else 'not met'}); "
              f"eot p90 at 4 <= 800 ms: {p90:.0f} ms ({'met' if p90 <= 800 else 'not met'})")
    if 1 in by_level and 8 in by_level:
        # NOTE: the session layer's goal (issue #9): first audio must not collapse under concurrency.
        ratio = by_level[8]["eot_p90_ms"] / by_level[1]["eot_p50_ms"]
        print(f"Goal: eot p90 at 8 sessions <= 2x p50 at 1: ratio {ratio:.2f} ({'met' if ratio <= 2 else 'not met'})")
    print("\n" + cpu_description())


if __name__ == "__main__":
    main()
