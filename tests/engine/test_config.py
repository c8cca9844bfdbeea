"""Pipeline config validation: every error names the stage and the field."""

from __future__ import annotations

import copy
import dataclasses
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from harness import CONFIGS

from voice_server.config import BudgetError, ConfigError, load_pipeline, pipeline_from_dict, plan_budget
from voice_server.config.budget import cgroup_memory_limit, host_memory_bytes

F = "voice_server.stages.numeric:create_echo"


def base() -> dict[str, Any]:
    return {
        "name": "t",
        "stages": [
            {"name": "a", "factory": F, "next": "b", "memory_fraction": 0.1},
            {"name": "b", "factory": F, "terminal": True, "memory_fraction": 0.1},
        ],
    }


def with_change(path: str, value: Any) -> dict[str, Any]:
    raw = copy.deepcopy(base())
    target: Any = raw
    *parents, last = path.split(".")
    for key in parents:
        target = target[int(key)] if key.isdigit() else target[key]
    if value is KeyError:
        del target[last]
    else:
        target[last] = value
    return raw


@pytest.mark.parametrize(
    ("path", "value", "needle"),
    [
        ("stages.0.colour", "red", "stage #0 'a': field 'colour': unknown field"),
        ("stages.0.next", "nowhere", "stage 'a': field 'next': unknown stage 'nowhere'"),
        ("stages.0.stream_to", ["ghost"], "stage 'a': field 'stream_to': unknown stage 'ghost'"),
        ("stages.1.next", "a", "routing cycle"),
        ("stages.1.terminal", False, "stage 'b': field 'terminal'"),
        ("stages.0.factory", KeyError, "stage #0 'a': field 'factory': missing"),
        ("stages.0.factory", "no_colon_here", "stage 'a': field 'factory'"),
        ("stages.0.scheduler", "fifo", "stage 'a': field 'scheduler'"),
        ("stages.0.tp_size", 2, "stage 'a': field 'tp_size'"),
        ("stages.0.memory_fraction", 0, "stage 'a': field 'memory_fraction'"),
        ("stages.0.device", "tpu", "stage 'a': field 'device'"),
        ("stages.1.name", "a", "stage 'a': field 'name': duplicate"),
        ("stages.0.name", "Bad Name", "field 'name'"),
        ("entry", "zzz", "field 'entry': unknown stage 'zzz'"),
        ("relay_slab_bytes", 10, "field 'relay_slab_bytes'"),
        ("stages", [], "field 'stages'"),
        ("stages.0.max_step_tokens", 0, "stage 'a': field 'max_step_tokens'"),
        ("stages.0.prefix_cache", "yes", "stage 'a': field 'prefix_cache'"),
    ],
)
def test_validation_errors_name_stage_and_field(path: str, value: Any, needle: str) -> None:
    with pytest.raises(ConfigError) as info:
        pipeline_from_dict(with_change(path, value))
    assert needle in str(info.value)


def test_an_ar_stage_needs_a_step_budget_for_every_running_request() -> None:
    raw = base()
    raw["stages"][0].update(scheduler="ar", max_batch_size=16, max_step_tokens=8)
    with pytest.raises(ConfigError, match=r"stage 'a': field 'max_step_tokens': must be >= max_batch_size \(16\)"):
        pipeline_from_dict(raw)
    raw["stages"][0]["max_step_tokens"] = 16
    assert pipeline_from_dict(raw).stages[0].max_step_tokens == 16


def test_no_terminal_stage_and_unreachable_stage() -> None:
    raw = base()
    raw["stages"][1]["terminal"] = False
    raw["stages"][1]["stream_to"] = ["a"]
    with pytest.raises(ConfigError, match="cycle"):
        pipeline_from_dict(raw)
    raw = base()
    raw["stages"].append({"name": "c", "factory": F, "terminal": True})
    with pytest.raises(ConfigError, match="stage 'c': field 'name': not reachable from entry 'a'"):
        pipeline_from_dict(raw)


def test_process_group_must_share_a_device() -> None:
    raw = base()
    raw["stages"][0].update(process="grp", device="cuda:0")
    raw["stages"][1].update(process="grp")
    with pytest.raises(ConfigError, match="stage 'b': field 'device': process 'grp' already holds a stage on cuda:0"):
        pipeline_from_dict(raw)


def test_valid_config_resolves_topology() -> None:
    cfg = load_pipeline(CONFIGS / "test_numeric.yaml")
    assert cfg.entry_stage == "framer"
    assert cfg.terminal_stages == ("sink",)
    assert cfg.reachable_from("framer") == ["framer", "transform", "sink"]
    assert list(cfg.processes) == ["framer", "transform", "sink"]
    assert cfg.stage("framer").stream_to == ("transform",)
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.stage("framer").name = "x"  # type: ignore[misc]


def test_budget_sums_per_device_and_refuses_overcommit() -> None:
    raw = base()
    raw["stages"][0]["memory_fraction"] = 0.7
    raw["stages"][1]["memory_fraction"] = 0.7
    with pytest.raises(BudgetError, match=r"device cpu is over budget: 1.400 > 1.0 \(a=0.7, b=0.7\)"):
        plan_budget(pipeline_from_dict(raw))
    raw["stages"][0]["device"] = "cuda:1"
    budgets = {b.stage: b for b in plan_budget(pipeline_from_dict(raw))}
    assert budgets["a"].device == "cuda:1" and budgets["a"].num_bytes is None
    assert budgets["b"].num_bytes is not None and budgets["b"].num_bytes > 0


def run_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "voice_server.cli", *args], capture_output=True, text=True, timeout=60)


def test_cpu_budgets_follow_a_container_memory_limit(tmp_path: Path) -> None:
    physical = host_memory_bytes(str(tmp_path / "none"))
    v2 = tmp_path / "v2"
    v2.mkdir()
    (v2 / "memory.max").write_text(f"{2**30}\n")
    assert cgroup_memory_limit(str(v2)) == 2**30 and host_memory_bytes(str(v2)) == min(physical, 2**30)
    (v2 / "memory.max").write_text("max\n")
    assert cgroup_memory_limit(str(v2)) is None and host_memory_bytes(str(v2)) == physical
    v1 = tmp_path / "v1"
    (v1 / "memory").mkdir(parents=True)
    (v1 / "memory/memory.limit_in_bytes").write_text("9223372036854771712\n")  # v1's "no limit"
    assert cgroup_memory_limit(str(v1)) is None
    (v1 / "memory/memory.limit_in_bytes").write_text(f"{3 * 2**30}\n")
    assert host_memory_bytes(str(v1)) == min(physical, 3 * 2**30)
    # This machine's own cgroup: whatever it says, the budget never exceeds physical RAM.
    assert 0 < host_memory_bytes() <= physical


def test_check_config_prints_topology_and_budget() -> None:
    out = run_cli("check-config", str(CONFIGS / "test_numeric.yaml"))
    assert out.returncode == 0, out.stderr
    assert "entry framer, terminal sink" in out.stdout
    assert "stream -> transform" in out.stdout
    assert "total cpu" in out.stdout and "0.03" in out.stdout


def test_check_config_reports_errors(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: x\nstages:\n  - {name: a, factory: 'm:f', memory_fraction: 0.8, next: b}\n"
                   "  - {name: b, factory: 'm:f', memory_fraction: 0.8, terminal: true}\n")
    out = run_cli("check-config", str(bad))
    assert out.returncode == 2
    assert "device cpu is over budget" in out.stderr and "a=0.8, b=0.8" in out.stderr
    out = run_cli("check-config", str(tmp_path / "missing.yaml"))
    assert out.returncode == 2 and "cannot read pipeline config" in out.stderr


def test_fan_in_is_refused() -> None:
    raw = base()
    raw["stages"][0]["stream_to"] = ["b"]  # a -> b twice (next and stream_to)
    with pytest.raises(ConfigError, match="stage 'b': field 'name': has several upstream stages"):
        pipeline_from_dict(raw)
    raw = base()
    raw["stages"].insert(1, {"name": "c", "factory": F, "next": "b"})
    raw["stages"][0]["stream_to"] = ["c"]
    with pytest.raises(ConfigError, match=r"has several upstream stages \(a, c\)"):
        pipeline_from_dict(raw)  # a -> b and a -> c -> b
