from voice_server.config.budget import BudgetError, StageBudget, format_budget, plan_budget
from voice_server.config.checks import check_environment, resolve_factory
from voice_server.config.errors import ConfigError
from voice_server.config.loading import MAX_DEPTH, MAX_FILE_BYTES, load_pipeline, pipeline_from_dict
from voice_server.config.pipeline import PipelineConfig, StageConfig
from voice_server.config.topology import MAX_STAGES
from voice_server.config.voices import OPENAI_VOICES, VoiceConfig

__all__ = [
    "MAX_DEPTH",
    "MAX_FILE_BYTES",
    "MAX_STAGES",
    "OPENAI_VOICES",
    "BudgetError",
    "ConfigError",
    "PipelineConfig",
    "StageBudget",
    "StageConfig",
    "VoiceConfig",
    "check_environment",
    "format_budget",
    "load_pipeline",
    "pipeline_from_dict",
    "plan_budget",
    "resolve_factory",
]
