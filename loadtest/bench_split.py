"""A voice session over `WS /ws` on the tiny Qwen3-Omni pipeline split across two Ray nodes: first audible reply
audio against the same pipeline on one host, same machine, side by side in one run.

`configs/qwen3-omni-tiny.yaml` (dummy weights, no checkpoint) is served twice at once, each by a real server in
this process (uvicorn with the session app over a coordinator and real stage processes: `tests/server/live_server.py`'s
`LiveServer`, as the session tests serve it):
- *single host*: the config as it is (local launcher, a process per stage);
- *split on 2 nodes*: the same with `launcher: ray` on a two-node Ray cluster of this host
  (`tests/ray_cluster.py`'s `TwoNodeCluster`: the head on 127.0.0.2 labelled `voice-server/role=thinker`, a worker
  on 127.0.0.3 labelled `role=talker`), the encoder and thinker placed on the head, the talker and code2wav on the
  worker, `control_transport: tcp` on 127.0.0.1, as `tests/runners/test_omni_ray_split.py` splits it; this process
  (the server) joins the cluster as a driver through the head's raylet (`connect_driver`), as a server on the
  thinker host does. The thinker -> talker and code2wav -> server hops cross nodes.

After a warm-up session on each, one session per config, manual turns (`turn_detection: null`: no VAD window in
the figure), `--turns` turns each, the two sessions' turns alternating (never two at once; each config first in
every other pair), so that both see the same machine over the run (an idle pipeline takes no CPU). A turn sends
~0.9 s of speech-like audio (`voice_server.audio.synthetic`, straight into the Omni encoder: the pipeline has no
asr stage), then `input.commit` and `response.create`. Measured at the client, from the commit (the end of the
user's audio, the request) to the first *audible* reply audio (the first 10 ms frame at -40 dBFS or more on the
client's playout clock, `PlayoutClock`; the tiny model's voice is noise, which is audible), and to the first reply
byte. The conversation grows turn by turn, the same in both. `mooncake_tensors`: tensors that crossed nodes over
Mooncake during the measured turns (every process's relay counters; tensors under `inline_threshold_bytes`, 16 KiB
by default, travel inside the control messages instead and are not counted; `--inline-threshold-bytes 64` sends
every tensor through the relay, as the split test does). Per-stage figures are the response's `timings_ms` (each
stage's first output after submit; both nodes share this host's clock).

Usage: OMP_NUM_THREADS=1 python loadtest/bench_split.py [--turns 10] [--inline-threshold-bytes N]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("OMP_NUM_THREADS", "1")
HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path[:0] = [str(HERE), str(ROOT / "tests"), str(ROOT / "tests" / "server")]

from bench_sessions import pct  # noqa: E402
from harness import Pipeline, shm_segments  # noqa: E402
from live_server import LiveServer  # noqa: E402
from ray_cluster import HEAD_IP, ROLE, WORKER_IP, TwoNodeCluster  # noqa: E402
from table import cpu_description, format_table  # noqa: E402
from websockets.sync.client import connect  # noqa: E402

from voice_server.audio import PlayoutClock, float32_to_pcm16, pcm16_from_bytes, pcm16_to_bytes  # noqa: E402
from voice_server.audio.synthetic import signal_of  # noqa: E402
from voice_server.config import pipeline_from_dict  # noqa: E402
from voice_server.config.loading import read_yaml  # noqa: E402

CONFIG = ROOT / "configs" / "qwen3-omni-tiny.yaml"
RATE, OUTPUT_RATE = 16000, 24000
FRAME = RATE // 50  # 20 ms
SPEECH_MS = 900
PARAMS = {"sampling": {"max_tokens": 16, "ignore_eos": True}, "talker": {"max_frames": 24}}
"""As `bench_sessions.py`: random weights may end a reply at once; a fixed length keeps the talker fed."""
ON_HEAD = ("encoder", "thinker")
STAGES = ("encoder", "thinker", "talker", "code2wav", "first_audio_sent", "first_audible")
SINGLE, SPLIT = "single host", "split on 2 nodes"


def split_config(raw: dict[str, Any], address: str) -> dict[str, Any]:
    """`raw` with the Ray fields: encoder + thinker on the head (role=thinker), talker + code2wav on the worker."""
    cfg = json.loads(json.dumps(raw))
    cfg.update(launcher="ray", ray_address=address, control_transport="tcp", tcp_host="127.0.0.1")
    for stage in cfg["stages"]:
        stage["placement"] = {"node_labels": {ROLE: "thinker" if stage["name"] in ON_HEAD else "talker"}}
    return cfg


class Session:
    """One `/ws` session with manual turns: each `turn` speaks, commits and asks for a response; per turn: ms from
    the commit to the first audible reply frame and to the first reply byte, and the response's `timings_ms`."""

    def __init__(self, port: int, stack: contextlib.ExitStack) -> None:
        pcm = float32_to_pcm16(signal_of(RATE, ("voice", SPEECH_MS)))
        self.frames = [pcm16_to_bytes(pcm[i:i + FRAME]) for i in range(0, len(pcm), FRAME)]
        self.ws = stack.enter_context(connect(f"ws://127.0.0.1:{port}/ws", open_timeout=10, max_size=None))
        self.ws.send(json.dumps({"type": "session.start", "input_rate": RATE, "output_rate": OUTPUT_RATE,
                                 "turn_detection": None, "params": PARAMS}))
        started = json.loads(self.ws.recv(10))
        if started.get("type") != "session.started":
            raise RuntimeError(f"session.start refused: {started}")

    def turn(self) -> dict[str, Any]:
        for frame in self.frames:  # NOTE: manual turns: no VAD to pace for, the commit ends the turn
            self.ws.send(frame)
        heard = PlayoutClock(OUTPUT_RATE)
        committed = time.monotonic()
        self.ws.send(json.dumps({"type": "input.commit"}))
        self.ws.send(json.dumps({"type": "response.create"}))
        while True:
            message = self.ws.recv(60)
            now = time.monotonic()
            if isinstance(message, bytes):
                heard.sent(pcm16_from_bytes(message), now)
                continue
            event = json.loads(message)
            if event["type"] == "error":
                raise RuntimeError(f"error event: {event}")
            if event["type"] == "response_done":
                break
        if event["status"] != "completed" or heard.first_audible_at is None or heard.first_byte_at is None:
            raise RuntimeError(f"a turn heard nothing: {event}")
        return {"first_audible_ms": 1000 * (heard.first_audible_at - committed),
                "first_byte_ms": 1000 * (heard.first_byte_at - committed), "timings": event.get("timings_ms", {})}


def relay_totals(pipeline: Pipeline) -> dict[str, int]:
    """Tensors (and bytes) exported to consumers on other nodes, summed over every stage process and the server."""
    counters = [pipeline.coordinator.io_counters]
    for reply in pipeline.run(pipeline.coordinator.stats()).values():
        counters.append(next(iter(reply.counters.values())))  # NOTE: a process's relay is shared by its stages
    return {key: sum(c.get(key, 0) for c in counters) for key in ("num_remote_puts", "num_remote_put_bytes")}


class Served:
    """A config served in this process: its pipeline (real stage processes) and a `LiveServer` over it."""

    def __init__(self, name: str, raw: dict[str, Any]) -> None:
        self.name = name
        start = time.monotonic()
        self.pipeline = Pipeline(pipeline_from_dict(raw))
        self.launch_id = self.pipeline.coordinator.launch_id
        self.server: LiveServer | None = None
        try:
            self.server = LiveServer(self.pipeline)
        except BaseException:
            self.close()
            raise
        self.startup_s = time.monotonic() - start
        self.results: list[dict[str, Any]] = []
        self.traffic: dict[str, int] = {}

    @property
    def port(self) -> int:
        assert self.server is not None
        return self.server.port

    @property
    def hosts(self) -> dict[str, str]:
        return {p: self.pipeline.coordinator.endpoints.host(p) for p in ("encoder", "thinker", "talker", "code2wav")}

    def close(self) -> list[str]:
        """Stop the server and the pipeline; the launch's shared-memory segments left behind (none expected)."""
        if self.server is not None:
            self.server.close()
            self.server = None
        self.pipeline.close()
        return shm_segments(self.launch_id)


def run(served: list[Served], num_turns: int) -> None:
    """A warm-up session on each, then one session on each with their turns alternating (never two at once, each
    config first in every other pair), so both see the same machine over the run."""
    for s in served:
        with contextlib.ExitStack() as stack:
            warm = Session(s.port, stack)
            for _ in range(2):  # NOTE: first-call paths, the relays' first remote puts
                warm.turn()
    before = {s.name: relay_totals(s.pipeline) for s in served}
    with contextlib.ExitStack() as stack:
        pairs = [(s, Session(s.port, stack)) for s in served]
        for k in range(num_turns):
            for s, session in pairs if k % 2 == 0 else pairs[::-1]:
                s.results.append(session.turn())
    for s in served:
        after = relay_totals(s.pipeline)
        s.traffic = {k: after[k] - before[s.name][k] for k in after}


def ray_processes(tmp_dir: Path) -> list[str]:
    """Ray processes of this run's cluster still alive (their command lines name its temp dir)."""
    out = subprocess.run(["pgrep", "-af", str(tmp_dir)], capture_output=True, text=True).stdout
    return [line for line in out.splitlines() if line.strip() and "pgrep" not in line]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--turns", type=int, default=10, help="measured turns per config, in one session")
    parser.add_argument("--inline-threshold-bytes", type=int, default=None,
                        help="set the pipeline's inline_threshold_bytes (both configs; default: the config's own)")
    args = parser.parse_args()
    print(cpu_description())
    raw = read_yaml(CONFIG)
    if args.inline_threshold_bytes is not None:
        raw["inline_threshold_bytes"] = args.inline_threshold_bytes
    tmp_dir = Path(tempfile.mkdtemp(prefix="ray", dir="/tmp"))  # NOTE: short: Ray's socket paths must fit
    cluster = TwoNodeCluster(tmp_dir)
    served: list[Served] = []
    notes: list[str] = []
    began = time.monotonic()
    try:
        cluster.start()
        cluster.connect_driver()
        for name, cfg in ((SINGLE, raw), (SPLIT, split_config(raw, cluster.address))):
            served.append(Served(name, cfg))
            notes.append(f"{name}: pipeline start + server up in {served[-1].startup_s:.1f} s")
        hosts, expected = served[1].hosts, {p: HEAD_IP if p in ON_HEAD else WORKER_IP for p in served[1].hosts}
        if hosts != expected:
            raise RuntimeError(f"the split stages run on {hosts}, not as placed ({expected})")
        notes.append(f"{SPLIT}: " + ", ".join(f"{p} on {h}" for p, h in hosts.items()))
        run(served, args.turns)
    finally:
        for s in served:
            if left := s.close():
                notes.append(f"{s.name}: LEFT {len(left)} /dev/shm segment(s) of its launch: {left[:4]}")
        cluster.shutdown()
        deadline = time.monotonic() + 10
        while (left := ray_processes(tmp_dir)) and time.monotonic() < deadline:
            time.sleep(0.2)
        shutil.rmtree(tmp_dir, ignore_errors=True)
        notes.append(f"Ray processes of the cluster left after shutdown: {len(left)}{f': {left[:3]}' if left else ''}")
    rows, stage_rows = [], []
    base: dict[str, float] = {}
    for s in served:
        name, traffic, results = s.name, s.traffic, s.results
        audible = [r["first_audible_ms"] for r in results]
        p50, p90 = pct(audible, 0.5), pct(audible, 0.9)
        base = base or {"p50": p50, "p90": p90}
        rows.append({"config": name, "turns": len(results), "first_audible_p50_ms": p50,
                     "first_audible_p90_ms": p90, "first_byte_p50_ms": pct([r["first_byte_ms"] for r in results], 0.5),
                     "p50_vs_single": p50 / base["p50"], "p90_vs_single": p90 / base["p90"],
                     "mooncake_tensors": traffic["num_remote_puts"],
                     "mooncake_kib": traffic["num_remote_put_bytes"] / 1024})
        stage_rows.append({"config": name, **{f"{stage}_ms": statistics.median(
            r["timings"].get(stage, float("nan")) for r in results) for stage in STAGES}})
    print(f"\n== A session over WS /ws: commit -> first audible reply audio, {CONFIG.name}, "
          f"{args.turns} turns in one session per config, same machine ==")
    print(format_table(rows))
    print("\n== Per stage: first output after submit (response timings_ms), ms, median ==")
    print(format_table(stage_rows))
    threshold = raw.get("inline_threshold_bytes", "the default (16384)")
    print(f"\ninline_threshold_bytes: {threshold}; params: {json.dumps(PARAMS)}; "
          f"run took {time.monotonic() - began:.0f} s")
    for note in notes:
        print(note)
    print("\n" + cpu_description())


if __name__ == "__main__":
    main()
