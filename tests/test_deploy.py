"""The GPU deployment pieces, on CPU: the 30B-A3B configs validate (topology, fields, budget, env), the
device check names a missing GPU, `preset: released` reads the released sizes (no weights built),
`loadtest/gpu_check.sh` is sound shell that stops at once without a GPU, and its bench runs on the
tiny preset."""

from __future__ import annotations

import dataclasses
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from voice_server.config import ConfigError, load_pipeline, plan_budget
from voice_server.config.checks import check_devices
from voice_server.engine.runtime import StageContext
from voice_server.models.qwen3_omni.config import Qwen3OmniConfig
from voice_server.models.qwen3_omni.talker.model import Talker
from voice_server.models.qwen3_omni.thinker.model import ThinkerModel
from voice_server.models.qwen3_omni.weights import build_on_meta
from voice_server.stages.omni_parts import read_omni_args

REPO = Path(__file__).resolve().parents[1]
GPU_CONFIGS = {"qwen3-omni-30b-a3b.yaml": {"cuda:0"}, "qwen3-omni-30b-a3b-2gpu.yaml": {"cuda:0", "cuda:1"}}
GPU_CHECK = REPO / "loadtest" / "gpu_check.sh"


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}


@pytest.mark.parametrize("name", list(GPU_CONFIGS))
def test_gpu_configs_validate(name: str) -> None:
    cfg = load_pipeline(REPO / "configs" / name)
    assert {s.device_key for s in cfg.stages} == GPU_CONFIGS[name]
    assert [s.name for s in cfg.stages] == ["encoder", "thinker", "talker", "code2wav"]
    budgets = plan_budget(cfg)
    for device in GPU_CONFIGS[name]:
        assert sum(b.fraction for b in budgets if b.device == device) < 0.9  # NOTE: room for CUDA contexts
    assert cfg.stage("code2wav").env == {"CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": "30"}
    for stage in cfg.stages:
        assert stage.factory_args["checkpoint"] == "/models/Qwen3-Omni-30B-A3B-Instruct"


def test_the_device_check_names_the_missing_gpu() -> None:
    cfg = load_pipeline(REPO / "configs" / "qwen3-omni-30b-a3b-2gpu.yaml")
    with pytest.raises(ConfigError, match=r"stage 'encoder': field 'device': cuda:1 is not on this host \(no CUDA "
                                          r"device visible\).*--skip-device-check"):
        check_devices(cfg, lambda: 0)
    with pytest.raises(ConfigError, match=r"cuda:1 is not on this host \(1 CUDA device visible\)"):
        check_devices(cfg, lambda: 1)
    check_devices(cfg, lambda: 2)
    check_devices(load_pipeline(REPO / "configs" / "qwen3-omni-tiny.yaml"), lambda: 1 // 0)  # NOTE: never asked


@pytest.mark.parametrize("name", list(GPU_CONFIGS))
def test_check_config_checks_all_but_the_devices_when_told(name: str) -> None:
    out = subprocess.run(
        [sys.executable, "-m", "voice_server.cli", "check-config", "--skip-device-check", f"configs/{name}"],
        cwd=REPO, env=_env(), capture_output=True, text=True, timeout=120,
    )
    assert out.returncode == 0, out.stderr
    assert "total cuda:0" in out.stdout and "--skip-device-check: this host was not checked" in out.stdout


def test_released_preset_reads_the_released_sizes_without_weights() -> None:
    cfg = load_pipeline(REPO / "configs" / "qwen3-omni-30b-a3b.yaml")
    stage = cfg.stage("thinker")
    args = {**stage.factory_args, "preset": "released"}
    del args["checkpoint"]
    stage = dataclasses.replace(stage, factory_args=args)
    omni = read_omni_args(StageContext(stage, cfg, None, "x"), ("sampling",))
    assert omni.cfg == Qwen3OmniConfig() and omni.checkpoint is None
    assert omni.cfg.thinker.text.num_hidden_layers == 48 and omni.cfg.talker.num_code_groups == 16
    # NOTE: the sizes the configs' memory plans quote, counted on the meta device (no memory).
    thinker = sum(p.numel() for p in build_on_meta(ThinkerModel, omni.cfg.thinker).parameters())
    talker = sum(p.numel() for p in build_on_meta(Talker, omni.cfg.talker).parameters())
    assert (round(thinker / 1e9, 2), round(talker / 1e9, 2)) == (31.18, 3.32)


def test_gpu_check_is_sound_shell() -> None:
    assert subprocess.run(["bash", "-n", str(GPU_CHECK)], capture_output=True, text=True).returncode == 0
    assert os.access(GPU_CHECK, os.X_OK)
    shellcheck = shutil.which("shellcheck")
    if shellcheck is not None:  # NOTE: not a skip: bash -n above always runs
        out = subprocess.run([shellcheck, str(GPU_CHECK)], capture_output=True, text=True)
        assert out.returncode == 0, out.stdout


def test_gpu_check_stops_at_once_without_a_gpu(tmp_path: Path) -> None:
    # NOTE: a fake nvidia-smi that finds nothing, so the test means the same on any machine.
    fake = tmp_path / "nvidia-smi"
    fake.write_text("#!/bin/sh\necho 'No devices were found' >&2\nexit 6\n")
    fake.chmod(0o755)
    out = subprocess.run(["bash", str(GPU_CHECK)], capture_output=True, text=True, timeout=60,
                         env={**_env(), "PATH": f"{tmp_path}{os.pathsep}{os.environ['PATH']}"})
    assert out.returncode == 3, (out.stdout, out.stderr)
    assert "nvidia-smi finds no usable GPU; nothing was run" in out.stderr
    out = subprocess.run(["bash", str(GPU_CHECK)], capture_output=True, text=True, timeout=60,
                         env={**_env(), "CUDA_GRAPHS": "sometimes"})
    assert out.returncode == 2 and "CUDA_GRAPHS must be off, on or both" in out.stderr


def test_gpu_check_skips_what_its_budget_cannot_fit(tmp_path: Path) -> None:
    # NOTE: a fake GPU and interpreter: the budget's bookkeeping is the unit here, not the checks.
    (tmp_path / "nvidia-smi").write_text("#!/bin/sh\necho '0, NVIDIA H200, 143771 MiB, 580'\n")
    (tmp_path / "python").write_text("#!/bin/sh\necho \"python $*\" >> \"$RUN_LOG\"\necho 1\n")
    for fake in tmp_path.iterdir():
        fake.chmod(0o755)
    env = {**_env(), "PATH": f"{tmp_path}{os.pathsep}{os.environ['PATH']}", "PYTHON": str(tmp_path / "python"),
           "RUN_LOG": str(tmp_path / "runs.log")}
    out = subprocess.run(["bash", str(GPU_CHECK)], capture_output=True, text=True, timeout=60,
                         env={**env, "GPU_CHECK_BUDGET_S": "29"})
    assert out.returncode == 4, (out.stdout, out.stderr)
    skipped = out.stdout.split("spent):\n")[1].splitlines()
    assert skipped[:2] == ["  check-config 1 GPU", "  30B-A3B pipeline, released shapes, graphs on"]
    assert len(skipped) == 9 and "  check-config 2 GPUs" in skipped
    assert "check-config" not in (tmp_path / "runs.log").read_text()  # only the torch probes ran
    out = subprocess.run(["bash", str(GPU_CHECK)], capture_output=True, text=True, timeout=60,
                         env={**env, "GPU_CHECK_BUDGET_S": "600", "CUDA_GRAPHS": "on"})
    assert out.returncode == 0 and "gpu_check: all checks passed" in out.stdout, (out.stdout, out.stderr)
    assert "graphs off" not in out.stdout and "(limit 240 s)" in out.stdout
    out = subprocess.run(["bash", str(GPU_CHECK)], capture_output=True, text=True, timeout=60,
                         env={**env, "GPU_CHECK_BUDGET_S": "ten minutes"})
    assert out.returncode == 2 and "GPU_CHECK_BUDGET_S must be a whole number" in out.stderr


@pytest.mark.parametrize("graphs", ["off", "on"])
def test_gpu_bench_talker_step_runs_on_the_tiny_preset(graphs: str) -> None:
    # NOTE: "on" runs the runner's fixed-shape decode path; on the CPU it is not captured, only run.
    out = subprocess.run(
        [sys.executable, "loadtest/bench_gpu.py", "talker", "--preset", "tiny", "--device", "cpu", "--dtype", "fp32",
         "--batches", "1,2", "--steps", "2", "--cuda-graphs", graphs],
        cwd=REPO, env=_env(), capture_output=True, text=True, timeout=120,
    )
    assert out.returncode == 0, out.stderr
    assert f"CUDA graphs: {graphs}" in out.stdout
    assert "batch   1: Talker+MTP step" in out.stdout and "batch   2: Talker+MTP step" in out.stdout


def test_gpu_bench_pipeline_names_where_a_late_request_got() -> None:
    # NOTE: on an H200 a request that hung (an error at the talker's admission, since fixed) used up the whole
    # check's limit and said nothing; now the batch fails after --request-timeout, naming the stages that
    # answered. The tiny pipeline on the CPU cannot stream a reply in 50 ms.
    out = subprocess.run(
        [sys.executable, "loadtest/bench_gpu.py", "pipeline", "--config", "configs/qwen3-omni-tiny.yaml",
         "--device", "cpu", "--request-timeout", "0.05"],
        cwd=REPO, env=_env(), capture_output=True, text=True, timeout=180,
    )
    assert out.returncode == 1, (out.stdout, out.stderr)
    assert "pipeline 'qwen3-omni-tiny' ready" in out.stdout
    assert "1 requests did not finish in 0.05 s; the stages that answered:" in out.stderr, out.stderr


def test_the_two_host_config_budgets_each_host_and_checks_without_a_cluster() -> None:
    """`configs/qwen3-omni-30b-a3b-2host.yaml` (`launcher: ray`): each host's cuda:0 is its own, and check-config
    says when no cluster answers instead of failing (the placements are checked where one does:
    tests/runners/test_omni_ray_split.py)."""
    cfg = load_pipeline(REPO / "configs" / "qwen3-omni-30b-a3b-2host.yaml")
    assert cfg.launcher == "ray" and cfg.control_transport == "tcp"
    roles = {s.name: s.placement.node_labels["voice-server/role"] for s in cfg.stages if s.placement is not None}
    assert roles == {"encoder": "thinker", "thinker": "thinker", "talker": "talker", "code2wav": "talker"}
    for host in {b.host for b in plan_budget(cfg)}:
        assert sum(b.fraction for b in plan_budget(cfg) if b.host == host) < 0.95, host
    out = subprocess.run(
        [sys.executable, "-m", "voice_server.cli", "check-config", "configs/qwen3-omni-30b-a3b-2host.yaml"],
        cwd=REPO, env={**_env(), "RAY_ADDRESS": ""}, capture_output=True, text=True, timeout=120,
    )
    assert out.returncode == 0, out.stderr
    assert "total cuda:0 on the node of placement voice-server/role=thinker  cuda:0  0.93" in out.stdout
    assert "note: no Ray cluster answers at auto" in out.stdout, out.stdout
