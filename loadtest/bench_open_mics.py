"""The server's CPU for open microphones: sessions connected and sending a room's floor, nobody speaking.

Most of a call is the other side talking or nobody talking, yet every session's input is turn-detected frame by
frame. Starts `voice-server serve` (a real process) and, per endpoint and floor level, opens `--sessions`
clients of `bench_turntaking.py` (20 ms frames at real-time pace, white noise at the floor); after a settling
second, the server process's CPU (utime + stime from procfs) and this process's (the clients') over
`--seconds`, each level in turn for `--rounds` rounds (the median reported). The floors compare side by side
in one run: a quiet room (-70 dBFS, under `semantic_vad`'s `SILENT_DB`: Silero is not run while nobody
speaks) and a noisy one (-45 dBFS: every window scored).

    OMP_NUM_THREADS=1 .venv/bin/python loadtest/bench_open_mics.py [--endpoints ws,twilio] [--sessions 8]
        [--floors=-70,-45] [--seconds 15] [--rounds 2]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_sessions import start_server  # noqa: E402
from table import cpu_description, format_table  # noqa: E402
from turntaking_clients import CLIENTS, Client  # noqa: E402
from turntaking_set import FRAME_S  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
SETTLE_S = 2.0


def process_cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def measure(port: int, server_pid: int, endpoint: str, num_sessions: int, floor_db: float,
            seconds: float) -> dict[str, float]:
    """The server's and the clients' CPU (cores) over `seconds` of `num_sessions` open microphones."""
    cls = type(f"Open{endpoint}", (CLIENTS[endpoint],), {"floor_db": floor_db})
    clients: list[Client] = []
    try:
        for seed in range(num_sessions):
            clients.append(cls(port, seed=seed).__enter__())
        time.sleep(SETTLE_S)
        server0, own0, start = process_cpu_s(server_pid), time.process_time(), time.monotonic()
        time.sleep(seconds)
        elapsed = time.monotonic() - start
        server = (process_cpu_s(server_pid) - server0) / elapsed
        own = (time.process_time() - own0) / elapsed
        problems = [p for c in clients for p in c.problems]
    finally:
        for client in clients:
            client.__exit__()
    if problems:
        raise RuntimeError(f"{endpoint}: {problems[:3]}")
    return {"server_cores": server, "clients_cores": own}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default=str(ROOT / "configs" / "default.yaml"))
    parser.add_argument("--endpoints", default="ws,twilio")
    parser.add_argument("--sessions", type=int, default=8)
    parser.add_argument("--floors", default="-70,-45", help="open-mic levels, dBFS")
    parser.add_argument("--seconds", type=float, default=15.0)
    parser.add_argument("--rounds", type=int, default=2, help="each level measured once a round, in turn")
    args = parser.parse_args()
    endpoints = args.endpoints.split(",")
    unknown = sorted(set(endpoints) - set(CLIENTS))
    if unknown:
        parser.error(f"unknown endpoints {unknown} (known: {sorted(CLIENTS)})")
    if args.sessions < 1 or args.rounds < 1 or args.seconds <= 0:
        parser.error("--sessions and --rounds must be >= 1, --seconds > 0")
    floors = [float(f) for f in args.floors.split(",")]
    log_path = Path(tempfile.mkstemp(prefix="open-mics-", suffix=".log")[1])
    proc, port = start_server(Path(args.config), log_path)
    measured: dict[tuple[str, float], list[dict[str, float]]] = {}
    try:
        # NOTE: an untimed pass first (the session's models load at the first session), then the levels in
        # turn, round after round, so that a VM's slow minutes fall on all of them.
        measure(port, proc.pid, endpoints[0], args.sessions, floors[0], SETTLE_S)
        for _ in range(args.rounds):
            for endpoint in endpoints:
                for floor_db in floors:
                    measured.setdefault((endpoint, floor_db), []).append(
                        measure(port, proc.pid, endpoint, args.sessions, floor_db, args.seconds))
    finally:
        proc.terminate()
        proc.wait(30)
    rows: list[dict[str, object]] = []
    for (endpoint, floor_db), runs in measured.items():
        server = [run["server_cores"] for run in runs]
        noisy = statistics.median(run["server_cores"] for run in measured[endpoint, floors[-1]])
        rows.append({"endpoint": endpoint, "sessions": args.sessions, "floor_dbfs": floor_db,
                     "server_cores": round(statistics.median(server), 3),
                     "rounds": " / ".join(f"{value:.3f}" for value in server),
                     "server_ms_per_frame": round(1000 * statistics.median(server) * FRAME_S / args.sessions, 3),
                     "clients_cores": round(statistics.median(run["clients_cores"] for run in runs), 3),
                     "vs_last_floor": round(statistics.median(server) / noisy, 2)})
    print(f"== Server CPU with {args.sessions} open microphones, nobody speaking ({args.seconds:.0f} s each, "
          f"median of {args.rounds} rounds) ==")
    print(format_table(rows))
    print(cpu_description())
    print(f"server log {log_path}")


if __name__ == "__main__":
    main()
