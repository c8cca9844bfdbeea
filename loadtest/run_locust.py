"""One headless locust run of `loadtest/locustfile.py` (what `make loadtest` runs), CSV output.

Starts `voice-server serve --config CONFIG` on a free port of 127.0.0.1 (or uses `--url`, a server
already running), writes the reference utterances if they are missing, runs locust headless with N users
for DURATION, and writes `PREFIX_stats.csv` (and locust's other CSVs) plus `PREFIX_run.json` (users,
config, endpoint, the command, the machine) for `loadtest/report.py`. Locust arguments after `--` are
passed through (e.g. `-- --barge-in 0.2`). `--one-process` serves the config with every stage in one
process group (`process: pipeline` on each stage, written to `runs/loadtest/CONFIG-one-process.yaml`),
for the report's separate-processes-vs-one-process comparison.

Usage: OMP_NUM_THREADS=1 python loadtest/run_locust.py --users 4 --duration 2m [--config configs/default.yaml]
       [--url http://HOST:PORT] [--endpoint ws] [--csv runs/loadtest/default-ws-u4] [--workers 0]
       [--one-process] [-- ...]
"""

from __future__ import annotations

import argparse
import json
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))
from bench_sessions import start_server  # noqa: E402
from table import cpu_description  # noqa: E402


def locust_command(url: str, users: int, duration: str, csv: Path, endpoint: str, extra: list[str]) -> list[str]:
    return [sys.executable, "-m", "locust", "-f", str(HERE / "locustfile.py"), "--headless", "-u", str(users),
            "-r", str(users), "-t", duration, "--host", url, "--csv", str(csv), "--only-summary",
            "--stop-timeout", "10", "--endpoint", endpoint, *extra]


def run_distributed(command: list[str], workers: int) -> int:
    """Master plus `workers` worker processes on 127.0.0.1 (locust's distributed mode)."""
    procs = [subprocess.Popen([*command, "--master", "--master-bind-host", "127.0.0.1",
                               "--expect-workers", str(workers)], cwd=ROOT)]
    try:
        for _ in range(workers):
            # NOTE: a worker takes the locustfile and the custom options from the master; --headless etc.
            # are master-only, so a worker gets only what it needs to connect.
            procs.append(subprocess.Popen([sys.executable, "-m", "locust", "-f", str(HERE / "locustfile.py"),
                                           "--worker", "--master-host", "127.0.0.1"], cwd=ROOT))
        return procs[0].wait()
    finally:
        for proc in procs[1:]:
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()


def one_process_config(config: Path, out_dir: Path) -> Path:
    """`config` with every stage in one process group: `CONFIG-one-process.yaml` in `out_dir`."""
    import yaml

    data = yaml.safe_load(config.read_text())
    for stage in data["stages"]:
        stage["process"] = "pipeline"
    path = out_dir / f"{config.stem}-one-process.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="configs/default.yaml")
    parser.add_argument("--url", default="", help="a running server (http://HOST:PORT); default: start one")
    parser.add_argument("--users", type=int, default=1)
    parser.add_argument("--duration", default="30s")
    parser.add_argument("--endpoint", default="ws")
    parser.add_argument("--csv", type=Path, default=None, help="CSV prefix (default runs/loadtest/CONFIG-ENDPOINT-uN)")
    parser.add_argument("--workers", type=int, default=0, help="distributed mode: a master plus N workers")
    parser.add_argument("--one-process", action="store_true", help="every stage in one process group")
    args, extra = parser.parse_known_args()
    extra = [a for a in extra if a != "--"]
    config = Path(args.config)
    out_dir = ROOT / "runs" / "loadtest"
    out_dir.mkdir(parents=True, exist_ok=True)
    if args.one_process:
        config = one_process_config(ROOT / config, out_dir)
    csv = args.csv or out_dir / f"{config.stem}-{args.endpoint.replace(',', '+')}-u{args.users}"
    csv.parent.mkdir(parents=True, exist_ok=True)
    if not (HERE / "utterances").exists() and not any(a.startswith("--utterances") for a in extra):
        subprocess.run([sys.executable, str(HERE / "make_utterances.py")], check=True)
    # NOTE: a SIGTERM (a killed `make loadtest`) must still stop the server this script started: the
    # default handler would exit without running the `finally` below and orphan it with its stages.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    proc, url = None, args.url
    if not url:
        proc, port = start_server(ROOT / config)
        url = f"http://127.0.0.1:{port}"
    try:
        command = locust_command(url, args.users, args.duration, csv, args.endpoint, extra)
        started = time.time()
        rc = run_distributed(command, args.workers) if args.workers else subprocess.run(command, cwd=ROOT).returncode
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(30)
    meta = {"users": args.users, "duration": args.duration, "endpoint": args.endpoint,
            "config": str(config) if not args.url else f"{args.url} (running server)",
            "workers": args.workers, "command": shlex.join(["python", *sys.argv]), "machine": cpu_description(),
            "started": started, "exit_code": rc}
    Path(f"{csv}_run.json").write_text(json.dumps(meta, indent=1) + "\n")
    print(f"wrote {csv}_stats.csv and {csv}_run.json (locust exit code {rc})")
    sys.exit(rc)


if __name__ == "__main__":
    main()
