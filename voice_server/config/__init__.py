from voice_server.config.budget import BudgetError, StageBudget, format_budget, plan_budget
from voice_server.config.pipeline import (
    ConfigError,
    PipelineConfig,
    StageConfig,
    load_pipeline,
    pipeline_from_dict,
)

__all__ = [
    "BudgetError",
    "ConfigError",
    "PipelineConfig",
    "StageBudget",
    "StageConfig",
    "format_budget",
    "load_pipeline",
    "pipeline_from_dict",
    "plan_budget",
]
