"""Resource probe of the soak run (`soak.py`): the RSS and open descriptors of a server's process tree and
the /dev/shm segments it maps, sampled over time, summarised into a table and judged against tolerances.

Everything comes from /proc: the tree is the server and its descendants (the stage processes, named
`voice-server[<process>]` by setproctitle), found through each process's parent pid, so a stage that
restarts shows up as a new row. Segments are the distinct /dev/shm paths in the tree's memory maps and
descriptors (other servers on the host have their own; a global count would mix them in).
"""

from __future__ import annotations

import os
import statistics
import time
from dataclasses import dataclass, field
from typing import Any

# NOTE: the tolerances of the verdict, from the figure after warm-up to the end of the run. RSS is
# allowed allocator noise and caches that settle late (5% or 20 MB, the larger); descriptors and
# segments must stay flat (a connection in flight holds a socket, a relay may map one overflow segment).
RSS_GROWTH_PCT, RSS_GROWTH_MB = 5.0, 20.0
FD_TOLERANCE, SHM_TOLERANCE = 4, 2
EDGE_SAMPLES = 3  # NOTE: "after warm-up" and "end" are medians of this many samples, not one noisy reading
# NOTE: judged on private memory (RssAnon). VmRSS also counts the relay slabs' shared pages as they are
# first touched: a ring of `relay_slab_bytes` per producer, mapped by its consumers, fills page by page
# over the first minutes and then stays (bounded, not a leak); VmRSS and RssShmem are reported only.
_REPORTED = frozenset({"rss_mb", "shmem_mb"})


def _stat(pid: int) -> tuple[int, str] | None:
    """(parent pid, state) of a live process, None when it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            text = f.read()
    except OSError:
        return None
    fields = text[text.rindex(")") + 2:].split()
    return int(fields[1]), fields[0]


def process_tree(root: int) -> list[int]:
    """`root` and its live descendants."""
    parents: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit() and (st := _stat(int(entry))) is not None and st[1] != "Z":
            parents.setdefault(st[0], []).append(int(entry))
    tree, todo = [], [root]
    while todo:
        pid = todo.pop()
        tree.append(pid)
        todo.extend(parents.get(pid, []))
    return tree


def label(pid: int, root: int) -> str:
    if pid == root:
        return "server"
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            first = f.read().split(b"\0")[0].decode(errors="replace")
    except OSError:
        return f"pid {pid}"
    # NOTE: stage processes are named `voice-server[thinker]`; anything else keeps its pid.
    return first if first.startswith("voice-server[") else f"{os.path.basename(first)} {pid}"


def memory_mb(pid: int) -> dict[str, float] | None:
    """VmRSS and its private (RssAnon) and shared-memory (RssShmem) parts, in MB."""
    fields = {"VmRSS:": "rss_mb", "RssAnon:": "anon_mb", "RssShmem:": "shmem_mb"}
    out = {}
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                key = line.split(None, 1)[0] if line.strip() else ""
                if key in fields:
                    out[fields[key]] = int(line.split()[1]) / 1024
    except OSError:
        return None
    return out if len(out) == len(fields) else None


def num_fds(pid: int) -> int | None:
    try:
        return len(os.listdir(f"/proc/{pid}/fd"))
    except OSError:
        return None


def shm_paths(pid: int) -> set[str]:
    paths: set[str] = set()
    try:
        with open(f"/proc/{pid}/maps") as f:
            paths.update(line.split(None, 5)[5].strip() for line in f if "/dev/shm/" in line)
        fd_dir = f"/proc/{pid}/fd"
        for fd in os.listdir(fd_dir):
            try:
                target = os.readlink(f"{fd_dir}/{fd}")
            except OSError:
                continue
            if target.startswith("/dev/shm/"):
                paths.add(target)
    except (OSError, IndexError):
        pass
    return {p.removesuffix(" (deleted)") for p in paths}


@dataclass
class Probe:
    """Samples of one process tree: `series[(metric, process)]` is a list of (seconds since start, value)."""

    root: int
    started: float = field(default_factory=time.monotonic)
    series: dict[tuple[str, str], list[tuple[float, float]]] = field(default_factory=dict)

    def _add(self, metric: str, name: str, now: float, value: float) -> None:
        self.series.setdefault((metric, name), []).append((now, value))

    def sample(self) -> None:
        now = time.monotonic() - self.started
        total_anon, total_fds, segments = 0.0, 0, set()
        for pid in process_tree(self.root):
            name, memory, fds = label(pid, self.root), memory_mb(pid), num_fds(pid)
            if memory is None or fds is None:
                continue  # NOTE: exited between the listing and the read
            for metric, value in memory.items():
                self._add(metric, name, now, value)
            self._add("fds", name, now, fds)
            total_anon += memory["anon_mb"]
            total_fds += fds
            segments |= shm_paths(pid)
        self._add("anon_mb", "all", now, total_anon)
        self._add("fds", "all", now, total_fds)
        self._add("shm_segments", "all", now, len(segments))


def _slope_per_min(points: list[tuple[float, float]]) -> float:
    """Least-squares slope of the points, per minute."""
    if len(points) < 2:
        return 0.0
    xs, ys = [p[0] for p in points], [p[1] for p in points]
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    var = sum((x - mx) ** 2 for x in xs)
    return 0.0 if var == 0 else 60.0 * sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / var


def _growth_limit(metric: str, base: float) -> float | None:
    if metric in _REPORTED:
        return None
    if metric == "anon_mb":
        return max(base * RSS_GROWTH_PCT / 100, RSS_GROWTH_MB)
    return FD_TOLERANCE if metric == "fds" else SHM_TOLERANCE


def summarize(probe: Probe, warmup_s: float) -> tuple[list[dict[str, Any]], list[str]]:
    """One table row per (metric, process), and the problems (an empty list is a pass).

    A process that came or went during the run (a restarted stage) is itself a problem: its figures
    would not compare.
    """
    rows, problems = [], []
    end_time = max((points[-1][0] for points in probe.series.values()), default=0.0)
    for (metric, name), points in probe.series.items():
        after = [v for t, v in points if t >= warmup_s]
        if points[0][0] > warmup_s or points[-1][0] < end_time:
            problems.append(f"{metric} {name}: the process did not live through the whole run")
        if len(after) < 2:
            continue
        base, end = statistics.median(after[:EDGE_SAMPLES]), statistics.median(after[-EDGE_SAMPLES:])
        growth, limit = end - base, _growth_limit(metric, base)
        is_ok = limit is None or (growth <= limit and (metric == "anon_mb" or growth >= -limit))
        rows.append({"metric": metric, "process": name, "start": points[0][1], "after_warmup": base, "end": end,
                     "max": max(v for _, v in points), "slope_per_min": _slope_per_min(
                         [(t, v) for t, v in points if t >= warmup_s]),
                     "growth": growth, "limit": limit, "ok": "-" if limit is None else "yes" if is_ok else "NO"})
        if not is_ok and limit is not None:
            problems.append(f"{metric} {name}: {base:.1f} after warm-up -> {end:.1f} at the end "
                            f"(tolerance {limit:.1f})")
    rows.sort(key=lambda r: (r["metric"], r["process"] != "all", r["process"]))
    return rows, problems
