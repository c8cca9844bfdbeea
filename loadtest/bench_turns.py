"""Spoken turns on the embedded CPU default (`configs/default.yaml`): first-audio latency at 1, 4 and 8
concurrent sessions, per-stage breakdown, and the thinker's decode speed.

Starts `voice-server serve` (a real process), then N clients over `WS /ws`. Each session asks the
questions below in turn (speech synthesised once with hibari-tts, streamed at real-time pace at 16 kHz
with silence around it, the silence streaming on until the reply is done), so later turns carry the
conversation so far. Measured per turn:
- `eot`: the server's end-of-turn decision -> its first reply audio byte sent (`timings_ms.first_audio_sent`
  of `response_done`; the server counts from the moment its VAD ended the turn);
- `spoken`: the last voiced sample the client sent -> the first reply audio byte the client received:
  what a person waits, the VAD's silence window (`silence_duration_ms`) included;
- per stage (ms after the end-of-turn decision, medians): `transcript` final, `thinker` first token,
  `talker` first audio;
- thinker decode: tokens per second of each reply (its text deltas, first to last), and the aggregate
  over all replies of a level (all tokens / the time any reply was decoding).
Goals, 2-core machine: eot p50 <= 300 ms at 1 session, eot p90 <= 800 ms at 4 (issue #10); eot p90 at
8 sessions no more than 2x p50 at 1 (issue #9). Sessions start 0-0.74 s apart and ask questions of
different lengths, so their turns end at different moments, as real users' do.

Usage: OMP_NUM_THREADS=1 python loadtest/bench_turns.py [--turns 20] [--levels 1,4,8] [--silence-ms 500]
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

from voice_server.audio import StreamResampler, float32_to_pcm16, pcm16_to_bytes  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
RATE = 16000
FRAME = RATE // 50  # 20 ms
QUESTIONS = ("What is the capital of France?", "How many legs does a spider have?", "What color is the sky?",
             "What is two plus two?", "Can you name a big animal?")
STAGES = ("transcript", "thinker", "talker", "first_audio_sent")


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

    def __init__(self, port: int, speech: list[np.ndarray], num_turns: int, silence_ms: int, offset: int) -> None:
        self.port, self.speech, self.num_turns = port, speech, num_turns
        self.silence_ms, self.offset = silence_ms, offset
        self.results: list[dict[str, Any]] = []
        self.error = ""

    def run(self) -> None:
        try:
            self._run()
        except Exception as exc:  # NOTE: reported in the table's notes, not a crash of the whole run
            self.error = f"{type(exc).__name__}: {exc}"

    def _run(self) -> None:
        with connect(f"ws://127.0.0.1:{self.port}/ws", open_timeout=10, max_size=None) as ws:
            ws.send(json.dumps({"type": "session.start", "input_rate": RATE, "output_rate": 24000,
                                "turn_detection": {"silence_duration_ms": self.silence_ms}}))
            json.loads(ws.recv(10))
            state: dict[str, Any] = {"turn": None}
            reader = threading.Thread(target=self._read, args=(ws, state), daemon=True)
            reader.start()
            silence = np.zeros(FRAME, np.int16)
            for k in range(self.num_turns):
                turn: dict[str, Any] = {"deltas": [], "done": threading.Event()}
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
                if turn["status"] != "completed" or "first_audio" not in turn:
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
                turn.setdefault("first_audio", now)
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
              silence_ms: int) -> tuple[list[dict[str, Any]], list[str]]:
    per_session = -(-min_turns // num_sessions)
    clients = [Turns(port, speech, per_session, silence_ms, offset=i) for i in range(num_sessions)]
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
    parser.add_argument("--silence-ms", type=int, default=500, help="server VAD silence window")
    args = parser.parse_args()
    print(cpu_description())
    speech = synthesize(QUESTIONS)
    start = time.monotonic()
    proc, port = start_server(Path(args.config))
    startup_s = time.monotonic() - start
    rows, stage_rows, notes, sample = [], [], [], ""
    try:
        run_level(port, speech, 1, 2, args.silence_ms)  # NOTE: warm-up (first-call paths, caches)
        memory = {label(pid, proc.pid): m["rss_mb"] for pid in process_tree(proc.pid)
                  if (m := memory_mb(pid)) is not None}
        for level in (int(x) for x in args.levels.split(",")):
            turns, errors = run_level(port, speech, level, args.turns, args.silence_ms)
            notes += [f"{level} sessions: {e}" for e in errors]
            if not turns:
                continue
            eot = [t["timings"]["first_audio_sent"] for t in turns if "first_audio_sent" in t["timings"]]
            spoken = [1000 * (t["first_audio"] - t["voice_end"]) for t in turns]
            single, aggregate = decode_rates(turns)
            rows.append({"sessions": level, "turns": len(turns), "eot_p50_ms": pct(eot, 0.5),
                         "eot_p90_ms": pct(eot, 0.9), "spoken_p50_ms": pct(spoken, 0.5),
                         "spoken_p90_ms": pct(spoken, 0.9), "decode_tok_s": single, "aggregate_tok_s": aggregate})
            stage_rows.append({"sessions": level, **{f"{s}_ms": statistics.median(
                t["timings"].get(s, float("nan")) for t in turns) for s in STAGES}})
            sample = sample or f"{turns[0].get('transcript', '?')!r} -> {turns[0]['text']!r}"
    finally:
        proc.terminate()
        proc.wait(30)
    print(f"\n== Spoken turns over WS /ws, {Path(args.config).name}, silence window {args.silence_ms} ms ==")
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
