"""`launcher: ray` and a stage's `placement` (`voice_server/config/placement.py`): every bad value is a ConfigError
naming the stage and the field; a good one reaches the process group (and each replica) unchanged."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from voice_server.config import ConfigError, load_pipeline, pipeline_from_dict
from voice_server.config.placement import Placement

FACTORY = "voice_server.stages.numeric:create_framer"


def config(*placements: Any, **pipeline: Any) -> dict[str, Any]:
    stages: list[dict[str, Any]] = []
    for i, placement in enumerate(placements):
        stage: dict[str, Any] = {"name": f"s{i}", "factory": FACTORY}
        if placement is not None:
            stage["placement"] = placement
        stages.append(stage)
    for here, there in zip(stages, stages[1:]):
        here["next"] = there["name"]
    stages[-1]["terminal"] = True
    return {"name": "placed", "stages": stages, **pipeline}


RAY = {"launcher": "ray", "control_transport": "tcp"}


def test_placements_reach_each_process_and_each_replica() -> None:
    raw = config({"node_labels": {"voice-server/role": "thinker"}}, {"resources": {"talker_host": 1, "GPU": 0.5}},
                 None, **RAY)
    raw["stages"][1]["replicas"] = 2
    cfg = pipeline_from_dict(raw)
    assert cfg.process_placement("s0") == Placement({"voice-server/role": "thinker"}, {})
    on_talker_host = Placement({}, {"talker_host": 1, "GPU": 0.5})
    assert cfg.process_placement("s1@0") == cfg.process_placement("s1@1") == on_talker_host
    assert cfg.process_placement("s2").is_empty
    assert cfg.launcher == "ray" and cfg.ray_address == "auto"
    assert pipeline_from_dict(config(None, None)).launcher == "local"
    # Ray's selector syntax on a label value.
    selectors = {"a": "!thinker", "b": "in(edge, phone)", "c": "!in(x,y)"}
    cfg = pipeline_from_dict(config({"node_labels": selectors}, **RAY))
    assert cfg.process_placement("s0").node_labels == selectors


@pytest.mark.parametrize(("placement", "extra", "needle"), [
    ({"resources": {"h": 1}}, {}, "stage 's0': field 'placement': needs `launcher: ray`"),
    ({"resources": {"h": 1}}, {"launcher": "ray"}, "field 'control_transport': must be tcp with `launcher: ray`"),
    ({"resources": {"h": 0}}, RAY, "field 'placement.resources.h': must be a number > 0"),
    ({"resources": {"h": True}}, RAY, "field 'placement.resources.h': must be a number > 0"),
    ({"resources": {"memory": 1e9}}, RAY, "field 'placement.resources.memory': is not placed per stage"),
    ({"resources": ["h"]}, RAY, "field 'placement.resources': must be a mapping"),
    ({"node_labels": {"role": 3}}, RAY, "field 'placement.node_labels.role': must be a label value"),
    ({"node_labels": {"role": "in(a,"}}, RAY, "field 'placement.node_labels.role': must be a label value"),
    ({"node_labels": {"bad key!": "x"}}, RAY, "field 'placement.node_labels': key 'bad key!' must match"),
    ({"nodes": 2}, RAY, "field 'placement.nodes': unknown field 'nodes' (known: node_labels, resources)"),
    ("talker", RAY, "field 'placement': must be a mapping with node_labels and/or resources"),
    (None, {**RAY, "launcher": "slurm"}, "field 'launcher': must be one of local, ray"),
])
def test_bad_placements_name_the_stage_and_field(placement: Any, extra: dict[str, Any], needle: str) -> None:
    with pytest.raises(ConfigError) as info:
        pipeline_from_dict(config(placement, None, **extra))
    assert needle in str(info.value), str(info.value)


def test_stages_of_one_process_group_must_agree_on_its_placement() -> None:
    raw = config({"resources": {"a": 1}}, {"resources": {"b": 1}}, **RAY)
    for stage in raw["stages"]:
        stage["process"] = "grp"
    with pytest.raises(ConfigError, match="stage 's1': field 'placement': differs from the placement of stage 's0': "
                                          "both run in process 'grp'"):
        pipeline_from_dict(raw)
    raw["stages"][1]["placement"] = {"resources": {"a": 1}}
    assert pipeline_from_dict(raw).process_placement("grp") == Placement({}, {"a": 1})


def test_a_yaml_placement_loads(tmp_path: Path) -> None:
    path = tmp_path / "placed.yaml"
    path.write_text(
        "name: placed\nlauncher: ray\nray_address: 10.0.0.1:6379\ncontrol_transport: tcp\ntcp_host: 10.0.0.2\n"
        f"stages:\n  - name: a\n    factory: {FACTORY}\n    terminal: true\n"
        "    placement:\n      node_labels: {voice-server/role: talker}\n      resources: {talker_host: 1}\n"
    )
    cfg = load_pipeline(path)
    assert cfg.ray_address == "10.0.0.1:6379"
    assert cfg.process_placement("a") == Placement({"voice-server/role": "talker"}, {"talker_host": 1})


def test_memory_fractions_add_up_per_node() -> None:
    from voice_server.config import BudgetError, plan_budget

    raw = config({"resources": {"thinker_host": 1}}, {"resources": {"talker_host": 1}}, **RAY)
    for stage in raw["stages"]:
        stage.update(device="cuda:0", memory_fraction=0.8)
    cfg = pipeline_from_dict(raw)
    assert [b.fraction for b in plan_budget(cfg)] == [0.8, 0.8]  # NOTE: two placements: two hosts' cuda:0
    with pytest.raises(BudgetError, match=r"device cuda:0 on node n1 is over budget: 1.600 > 1.0 \(s0=0.8, s1=0.8\)"):
        plan_budget(cfg, {"s0": "n1", "s1": "n1"})  # NOTE: placed, both landed on one node
    assert len(plan_budget(cfg, {"s0": "n1", "s1": "n2"})) == 2
    raw["stages"][1]["placement"] = raw["stages"][0]["placement"]
    with pytest.raises(BudgetError, match=r"device cuda:0 on the node of placement thinker_host:1 is over budget"):
        plan_budget(pipeline_from_dict(raw))


_WITHOUT_RAY = r'''
import asyncio, importlib.abc, sys

class NoRay(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name.split(".")[0] in ("ray", "mooncake"):
            raise ImportError(f"{name} is not installed here")
        return None

sys.meta_path.insert(0, NoRay())
import numpy as np
from voice_server.config import load_pipeline
from voice_server.engine.coordinator import Coordinator

async def main():
    coordinator = Coordinator(load_pipeline("configs/test_numeric.yaml"))
    await coordinator.start()
    try:
        outputs = [o async for o in coordinator.submit({"signal": np.ones(10000, np.float32)})]
    finally:
        await coordinator.stop()
    assert outputs[-1].is_final and outputs[-1].payload["num_frames"] == 3, outputs[-1]
    assert not [m for m in sys.modules if m.split(".")[0] in ("ray", "mooncake")]
    print("served without ray")

asyncio.run(main())
'''


def test_a_local_launch_needs_neither_ray_nor_mooncake() -> None:
    """`make run` installs neither: a local pipeline starts, serves and stops with both unimportable."""
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[2]
    done = subprocess.run([sys.executable, "-c", _WITHOUT_RAY], cwd=root, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "served without ray" in done.stdout
