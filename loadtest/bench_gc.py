"""Garbage-collector pauses in a stage process: a full (generation 2) `gc.collect()` over the heap a stage
has once it has loaded, before and after `gc.freeze()`, which every stage process does once its runner is
built (`voice_server/engine/runtime.py: freeze_startup_heap`, as vLLM does after loading its model).

The heap is built the way a stage process builds it: the config's stage -> `create_runner(StageContext(...))`
(its factory: imports, weights loaded, warm-up) and `create_scheduler`, each stage in a fresh process of
its own (`--stage` repeated; by default every stage of the config). A full collection walks every object
the collector tracks; one that ran while a stage streams a reply would stall that stage's step for the
whole walk. After the freeze the objects loaded at start-up sit in the permanent generation, which no
collection scans.

Columns: `stage`; `load_s` (runner and scheduler built); `tracked` (objects the collector tracks once
loaded, `len(gc.get_objects())`); `freeze_ms` (the one `gc.collect(); gc.freeze()` at start-up);
`frozen` (`gc.get_freeze_count()` after it); `gen2_ms_before`: the median of `--repeats` full collections
before the freeze (`_max`: the slowest); `gen2_us_after`: the same after it, in microseconds, over the objects
left unfrozen (`tracked_after`: none but the bench's own here; in a serving stage, its requests' state);
`gen0_us`: a young-generation collection after the freeze (what runs most often, for scale).

Usage: OMP_NUM_THREADS=1 .venv/bin/python loadtest/bench_gc.py [--config configs/default.yaml]
       [--stage thinker] [--repeats 20]
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("OMP_NUM_THREADS", "1")

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_CONFIG = ROOT / "configs" / "default.yaml"


def timed_collections(generation: int, repeats: int) -> list[float]:
    """Milliseconds of `repeats` collections of `generation` (and the younger ones)."""
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        gc.collect(generation)
        times.append(1e3 * (time.perf_counter() - start))
    return times


def measure_stage(config: Path, stage_name: str, repeats: int) -> dict[str, Any]:
    """Build one stage as its process does, then time full collections before and after the freeze."""
    from voice_server.config import load_pipeline, plan_budget
    from voice_server.engine.runtime import StageContext, create_runner, create_scheduler, freeze_startup_heap

    cfg = load_pipeline(str(config))
    stage = next((s for s in cfg.stages if s.name == stage_name), None)
    if stage is None:
        raise SystemExit(f"no stage {stage_name!r} in {config} (stages: {', '.join(s.name for s in cfg.stages)})")
    budgets = {b.stage: b.num_bytes for b in plan_budget(cfg)}
    start = time.perf_counter()
    # NOTE: no `report`: outside a stage process `create_runner` leaves the heap unfrozen, so it is timed here.
    runner = create_runner(StageContext(stage, cfg, budgets.get(stage.name), "bench-gc"))
    scheduler = create_scheduler(stage, runner)
    load_s = time.perf_counter() - start
    gc.collect()
    num_tracked = len(gc.get_objects())
    before = timed_collections(2, repeats)
    start = time.perf_counter()
    freeze_startup_heap()
    freeze_ms = 1e3 * (time.perf_counter() - start)
    num_frozen = gc.get_freeze_count()
    num_unfrozen = len(gc.get_objects())
    after = timed_collections(2, repeats)
    young = timed_collections(0, repeats)
    del runner, scheduler
    return {
        "stage": stage.name, "load_s": load_s, "tracked": num_tracked, "freeze_ms": freeze_ms, "frozen": num_frozen,
        "gen2_ms_before": statistics.median(before), "gen2_ms_before_max": max(before),
        "tracked_after": num_unfrozen, "gen2_us_after": 1e3 * statistics.median(after),
        "gen2_us_after_max": 1e3 * max(after), "gen0_us": 1e3 * statistics.median(young),
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--config", type=Path, default=DEFAULT_CONFIG)
    parser.add_argument("--stage", action="append", default=[], help="a stage of the config (repeatable; default all)")
    parser.add_argument("--repeats", type=int, default=20, help="collections timed per measurement")
    parser.add_argument("--one", default=None, help=argparse.SUPPRESS)  # NOTE: the child that measures one stage
    args = parser.parse_args()
    if args.one is not None:
        print(json.dumps(measure_stage(args.config, args.one, args.repeats)))
        return
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from table import cpu_description, format_table

    from voice_server.config import load_pipeline

    names = args.stage or [s.name for s in load_pipeline(str(args.config)).stages]
    rows = []
    for name in names:
        # NOTE: one process per stage, as in the server: each heap is measured alone.
        done = subprocess.run(
            [sys.executable, __file__, "--config", str(args.config), "--one", name, "--repeats", str(args.repeats)],
            capture_output=True, text=True, cwd=ROOT,
        )
        if done.returncode != 0:
            raise SystemExit(f"stage {name}: exit {done.returncode}\n{done.stderr}")
        rows.append(json.loads(done.stdout.strip().splitlines()[-1]))
    print(cpu_description())
    print(f"config: {args.config.relative_to(ROOT) if args.config.is_relative_to(ROOT) else args.config}; "
          f"python {sys.version.split()[0]}; {args.repeats} collections per median")
    print(format_table(rows))


if __name__ == "__main__":
    main()
