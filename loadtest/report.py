"""Markdown tables and PNG plots from locust runs (`loadtest/run_locust.py`) and benchmark outputs.

Reads every `PREFIX_stats.csv` with its `PREFIX_run.json` under the given folders or prefixes (e.g. the
runs at 1, 4, 8 and 16 users of each config), prints markdown tables (for docs/BENCHMARKS.md), and draws
(matplotlib, Agg) into `--img`:
- `loadtest-first-audio.png`: time to first audio (p50 and p90) against concurrent users;
- `loadtest-rtf.png`: the replies' real-time factor (generation time / audio length, median) against
  concurrent users (below 1: audio comes faster than it plays);
- `loadtest-processes.png`, when runs of `run_locust.py --one-process` are among them: first audio and
  turn time against users, each stage in its own process vs every stage in one process group.
Each figure states the command and the machine (`cpu_description()` of the runs). `--bench FILE` adds
a benchmark script's printed tables (e.g. `loadtest/bench_turns.py > turns.txt`) under its own heading.

Usage: python loadtest/report.py runs/loadtest [--img docs/img] [--bench turns.txt ...] [--out report.md]
"""

from __future__ import annotations

import argparse
import csv
import json
import re
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent


def load_runs(sources: list[Path]) -> list[dict[str, Any]]:
    """One dict per run: its meta (`_run.json`) and `entries`: (endpoint, name) -> the CSV row."""
    prefixes: list[Path] = []
    for source in sources:
        if source.is_dir():
            prefixes += sorted(p.with_name(p.name[:-len("_stats.csv")]) for p in source.glob("*_stats.csv"))
        else:
            prefixes.append(source)
    runs = []
    for prefix in prefixes:
        meta_path = Path(f"{prefix}_run.json")
        meta = json.loads(meta_path.read_text()) if meta_path.exists() else {"users": 0, "config": "?"}
        with open(f"{prefix}_stats.csv") as f:
            meta["entries"] = {(row["Type"], row["Name"]): row for row in csv.DictReader(f)}
        meta["name"] = prefix.name
        runs.append(meta)
    return sorted(runs, key=lambda r: (str(r["config"]), str(r.get("endpoint")), int(r["users"])))


def _num(row: dict[str, str] | None, column: str) -> float | None:
    if row is None or not int(row["Request Count"]) or row.get(column) in (None, "", "N/A"):
        return None
    return float(row[column])


def rows_of(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    rows = []
    for run in runs:
        entries = run["entries"]
        endpoints = sorted({t for t, n in entries if t and n != "errors"})
        for endpoint in endpoints:
            get = lambda name: entries.get((endpoint, name))  # noqa: B023
            rtf = _num(get("gen_ms_per_audio_s"), "50%")
            errors = sum(int(r["Failure Count"]) for (t, n), r in entries.items() if t == endpoint)
            rows.append({
                "config": Path(str(run["config"])).stem, "endpoint": endpoint, "users": int(run["users"]),
                "turns": int(get("turn")["Request Count"]) if get("turn") else 0,
                "first_audio_p50_ms": _num(get("time_to_first_audio"), "50%"),
                "first_audio_p90_ms": _num(get("time_to_first_audio"), "90%"),
                "first_audio_p99_ms": _num(get("time_to_first_audio"), "99%"),
                "turn_p50_ms": _num(get("turn"), "50%"), "turn_p90_ms": _num(get("turn"), "90%"),
                "underrun_avg_ms": _num(get("underrun"), "Average Response Time"),
                "underrun_p90_ms": _num(get("underrun"), "90%"),
                "rtf_p50": None if rtf is None else rtf / 1000,
                "barge_in_p50_ms": _num(get("barge_in"), "50%"), "errors": errors,
            })
    return rows


def markdown_table(rows: list[dict[str, Any]]) -> str:
    if not rows:
        return "(no runs)"
    columns = list(rows[0])
    fmt = lambda v: "" if v is None else (f"{v:.3g}" if isinstance(v, float) and v < 10 else
                                          f"{v:.0f}" if isinstance(v, float) else str(v))
    lines = ["| " + " | ".join(columns) + " |", "|" + "|".join("---" for _ in columns) + "|"]
    lines += ["| " + " | ".join(fmt(row[c]) for c in columns) + " |" for row in rows]
    return "\n".join(lines)


def caption(runs: list[dict[str, Any]]) -> str:
    commands = sorted({re.sub(r"--users \d+", "--users N", str(r.get("command", "?"))) for r in runs})
    machines = sorted({str(r.get("machine", "?")) for r in runs})
    return "\n".join([*commands, *machines])


def plot(rows: list[dict[str, Any]], runs: list[dict[str, Any]], out: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out.mkdir(parents=True, exist_ok=True)
    series: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for row in rows:
        series.setdefault((row["config"], row["endpoint"]), []).append(row)
    figures = [("loadtest-first-audio.png", "Time to first audio vs concurrent users",
                "ms (end of speech -> first byte)",
                [("first_audio_p50_ms", "p50", "-"), ("first_audio_p90_ms", "p90", "--")]),
               ("loadtest-rtf.png", "Real-time factor of replies vs concurrent users",
                "generation time / audio length (median)", [("rtf_p50", "median", "-")])]
    written = []
    for filename, title, ylabel, keys in figures:
        fig, ax = plt.subplots(figsize=(8, 5.2))
        for (config, endpoint), points in sorted(series.items()):
            for key, label, style in keys:
                xy = [(p["users"], p[key]) for p in points if p[key] is not None]
                if xy:
                    ax.plot(*zip(*xy), style, marker="o", label=f"{config} {endpoint} {label}")
        if filename == "loadtest-rtf.png":
            ax.axhline(1.0, color="grey", linewidth=0.8)  # NOTE: above 1 a reply plays faster than it arrives
        ax.set(title=title, xlabel="concurrent users (sessions)", ylabel=ylabel)
        ax.set_xticks(sorted({row["users"] for row in rows}))
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
        fig.text(0.01, 0.01, caption(runs), fontsize=5.5, va="bottom", wrap=True)
        fig.subplots_adjust(bottom=0.2)
        fig.savefig(out / filename, dpi=110)
        plt.close(fig)
        written.append(out / filename)
    processes = plot_processes(plt, series, runs, out)
    return written + ([processes] if processes else [])


ONE_PROCESS = "-one-process"


def plot_processes(plt: Any, series: dict[tuple[str, str], list[dict[str, Any]]], runs: list[dict[str, Any]],
                   out: Path) -> Path | None:
    """Separate stage processes vs one process group, for every config run both ways."""
    pairs = [(key, (key[0] + ONE_PROCESS, key[1])) for key in series if (key[0] + ONE_PROCESS, key[1]) in series]
    if not pairs:
        return None
    fig, axes = plt.subplots(1, 2, figsize=(11, 5.2))
    for ax, (key, label) in zip(axes, [("first_audio", "first audio"), ("turn", "turn")]):
        for separate, together in pairs:
            for name, points, style in ((f"{separate[0]}: a process per stage", series[separate], "-"),
                                        (f"{separate[0]}: one process", series[together], "--")):
                for pct in ("p50", "p90"):
                    xy = [(p["users"], p[f"{key}_{pct}_ms"]) for p in points if p[f"{key}_{pct}_ms"] is not None]
                    if xy:
                        ax.plot(*zip(*xy), style, marker="o" if pct == "p50" else "s", label=f"{name} {pct}")
        ax.set(title=f"{label} vs concurrent users", xlabel="concurrent users (sessions)", ylabel="ms")
        ax.set_xticks(sorted({p["users"] for points in series.values() for p in points}))
        ax.grid(alpha=0.3)
        ax.legend(fontsize=6.5)
    fig.text(0.01, 0.01, caption(runs), fontsize=5.5, va="bottom", wrap=True)
    fig.subplots_adjust(bottom=0.22)
    path = out / "loadtest-processes.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def bench_sections(paths: list[Path]) -> str:
    """The tables and headings of a benchmark script's printed output (e.g. `loadtest/bench_turns.py`)."""
    parts = []
    for path in paths:
        kept = [line for line in path.read_text().splitlines()
                if line.startswith(("|", "==", "CPU:", "Goal", "error"))]
        parts.append(f"### {path.stem}\n\n" + "\n".join(kept))
    return "\n\n".join(parts)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("sources", nargs="+", type=Path, help="folders of runs, or CSV prefixes")
    parser.add_argument("--img", type=Path, default=ROOT / "docs" / "img")
    parser.add_argument("--bench", type=Path, nargs="*", default=[])
    parser.add_argument("--out", type=Path, default=None, help="also write the markdown here")
    args = parser.parse_args()
    runs = load_runs(args.sources)
    rows = rows_of(runs)
    images = plot(rows, runs, args.img)
    text = "\n\n".join(filter(None, [
        "## Load test (locust)", markdown_table(rows), "```\n" + caption(runs) + "\n```",
        "\n".join(f"![{p.stem}](img/{p.name})" for p in images), bench_sections(args.bench)])) + "\n"
    print(text)
    if args.out:
        args.out.write_text(text)


if __name__ == "__main__":
    main()
