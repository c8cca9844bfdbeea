"""Plain-text tables for benchmark scripts (rows are dicts; columns in first-seen order)."""

from __future__ import annotations

from typing import Any


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4g}" if abs(value) < 1e4 else f"{value:.0f}"
    return "" if value is None else str(value)


def format_table(rows: list[dict[str, Any]]) -> str:
    columns: list[str] = []
    for row in rows:
        columns.extend(k for k in row if k not in columns)
    cells = [columns] + [[_fmt(row.get(c)) for c in columns] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(columns))]
    lines = ["| " + " | ".join(c.ljust(w) for c, w in zip(r, widths)) + " |" for r in cells]
    lines.insert(1, "|" + "|".join("-" * (w + 2) for w in widths) + "|")
    return "\n".join(lines)


def cpu_description() -> str:
    """One line naming the CPU, its vector/matrix extensions and torch's kernel level (printed with
    every table: machines here differ, some AVX2 only, some with AVX512-BF16)."""
    import os
    import platform
    from pathlib import Path

    import torch

    model, flags = platform.processor() or "unknown CPU", set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name") and model in ("", "unknown CPU", platform.processor()):
                model = line.partition(":")[2].strip()
            elif line.startswith("flags") and not flags:
                flags = set(line.partition(":")[2].split())
    except OSError:
        pass
    wanted = ("avx2", "avx512f", "avx512_vnni", "avx_vnni", "avx512_bf16", "amx_bf16", "amx_int8")
    shown = " ".join(f"{f}={'yes' if f in flags else 'no'}" for f in wanted)
    return (f"CPU: {model}, {os.cpu_count()} logical cores; {shown}; "
            f"torch {torch.__version__} kernels: {torch.backends.cpu.get_cpu_capability()}")
