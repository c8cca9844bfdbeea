"""`check-config`'s memory report (`voice_server/config/budget.py`: `plan_memory`, `format_budget`): each
Qwen3-Omni stage's weights, activation budget or reserve and KV cache, planned without loading anything,
equal what the built stages hold and size."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from voice_server.config import PipelineConfig, StageConfig, format_budget, pipeline_from_dict, plan_budget
from voice_server.config.budget import StageMemory, plan_memory
from voice_server.engine.runtime import StageContext
from voice_server.runners.sizing import weight_bytes

torch.set_num_threads(1)
ARGS = {"preset": "tiny", "seed": 0, "num_threads": 1}


def pipeline(encoder_args: dict[str, Any]) -> PipelineConfig:
    return pipeline_from_dict({"name": "omni", "stages": [
        {"name": "encoder", "factory": "voice_server.stages.audio_encoder:create_audio_encoder", "next": "thinker",
         "memory_fraction": 0.01, "factory_args": {**ARGS, **encoder_args}},
        {"name": "thinker", "factory": "voice_server.stages.thinker:create_thinker", "scheduler": "ar",
         "terminal": True, "stream_to": ["talker"], "max_batch_size": 4, "max_step_tokens": 64,
         "memory_fraction": 0.01, "factory_args": ARGS},
        {"name": "talker", "factory": "voice_server.stages.talker:create_talker", "scheduler": "ar",
         "stream_to": ["code2wav"], "max_batch_size": 4, "max_step_tokens": 64, "memory_fraction": 0.01,
         "factory_args": ARGS},
        {"name": "code2wav", "factory": "voice_server.stages.code2wav:create_code2wav", "scheduler": "code2wav",
         "terminal": True, "memory_fraction": 0.01, "factory_args": ARGS},
    ]})


def build(stage: StageConfig, cfg: PipelineConfig, budget_bytes: int) -> Any:
    from voice_server.config import resolve_factory

    return resolve_factory(stage)(StageContext(stage, cfg, budget_bytes, "t"))


def test_the_plan_equals_what_the_built_stages_hold() -> None:
    cfg = pipeline({"vision": True, "activation_budget_mb": 8})
    plan = plan_memory(cfg)
    budgets = {b.stage: b for b in plan_budget(cfg)}
    assert all(isinstance(m, StageMemory) for m in plan.values())
    stages = {s.name: s for s in cfg.stages}
    encoder = build(stages["encoder"], cfg, 2**30)
    assert plan["encoder"] == StageMemory(weight_bytes(encoder.tower) + weight_bytes(encoder.vision_tower), 8 * 2**20)
    for name in ("thinker", "talker"):
        runner = build(stages[name], cfg, budgets[name].num_bytes or 0)
        memory = plan[name]
        assert isinstance(memory, StageMemory) and memory.kv_bytes_per_token is not None
        assert (memory.weight_bytes, memory.activation_bytes) == (runner.plan.weight_bytes, runner.plan.reserve_bytes)
        # NOTE: the runner keeps one page for padding rows; the report counts the cache's bytes as a whole.
        assert memory.kv_bytes_per_token * runner.plan.page_size * (runner.plan.num_pages + 1) == runner.plan.kv_bytes
    code2wav = build(stages["code2wav"], cfg, 2**30)
    assert plan["code2wav"] == StageMemory(weight_bytes(code2wav.model))


def test_the_report_shows_weights_activations_and_kv_per_stage() -> None:
    cfg = pipeline({"vision": True, "activation_budget_mb": 8})
    budgets, plan = plan_budget(cfg), plan_memory(cfg)
    lines = format_budget(budgets, plan).splitlines()
    assert lines[0].split() == ["stage", "device", "fraction", "budget", "weights", "activations", "KV", "cache"]
    thinker = plan["thinker"]
    budget = next(b for b in budgets if b.stage == "thinker").num_bytes
    assert isinstance(thinker, StageMemory) and budget is not None and thinker.kv_bytes_per_token is not None
    tokens = (budget - thinker.weight_bytes - (thinker.activation_bytes or 0)) // thinker.kv_bytes_per_token
    assert f"({tokens} tokens)" in lines[2] and lines[1].split()[7:] == ["8.0", "MiB", "-"]
    assert lines[-1].startswith("total cpu")
    # Without the memory plan, the table is the budget alone (as before).
    assert format_budget(budgets).splitlines()[0].split() == ["stage", "device", "fraction", "budget"]


def test_a_stage_the_plan_cannot_size_is_named_with_the_reason(tmp_path: Any) -> None:
    raw = {"name": "mixed", "stages": [
        {"name": "echo", "factory": "voice_server.stages.numeric:create_echo", "next": "encoder",
         "memory_fraction": 0.01},
        {"name": "encoder", "factory": "voice_server.stages.audio_encoder:create_audio_encoder", "terminal": True,
         "memory_fraction": 0.01, "device": "cuda:0", "factory_args": {"checkpoint": str(tmp_path / "none")}},
    ]}
    cfg = pipeline_from_dict(raw)
    plan = plan_memory(cfg)
    assert plan["echo"] == "not planned by its factory"
    assert isinstance(plan["encoder"], str) and "factory_args.checkpoint" in plan["encoder"]
    text = format_budget(plan_budget(cfg), plan)
    assert "(echo: not planned by its factory)" in text and "(resolved on device)" in text
    with pytest.raises(ValueError, match="StageMemory.weight_bytes"):
        StageMemory(-1)
