"""A stage process's CPU priority: the stage field `nice` (Unix nice, -20..19; higher yields the CPU to others).

Why: on a host with fewer cores than busy processes, the kernel shares the CPU evenly, and the stage that must
keep pace with live input (a recogniser fed while people speak) falls behind the ones that can run ahead of
playback (a thinker or a talker whose audio is queued at the client). A recogniser behind delays every turn's
final transcript, which everything after it waits for: on 2 vCPUs with 8 people speaking at once, p90 end of
speech -> audible reply was 1.31-4.24 s (median of 3 runs 1.65 s) with every process at 0, 1.09-1.39 s (1.28 s)
with the thinker and talker at nice 8, runs alternating, each pair better with nice (`loadtest/bench_turntaking.py`,
docs/BENCHMARKS.md). At 1 session it changed nothing (p50 314-347 ms either way), nor does it with cores to spare.

Stages in one process group share one process, so they must agree on it. A value below the server's own needs
the privilege to raise a priority (CAP_SYS_NICE, or RLIMIT_NICE); without it the process logs a warning and
keeps its priority (a priority is a tuning, never a reason not to serve).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from voice_server.config.topology import check_group_agrees

if TYPE_CHECKING:
    from voice_server.config.pipeline import StageConfig

__all__ = ["check_process_nice", "process_nice"]


def check_process_nice(stages: Sequence[StageConfig]) -> None:
    """The stages of one process group agree on its `nice`."""
    check_group_agrees(stages, "nice", "has one priority")


def process_nice(stages: Sequence[StageConfig]) -> int:
    """The `nice` of a process group (checked consistent by `check_process_nice`); 0 for none."""
    return stages[0].nice if stages else 0
