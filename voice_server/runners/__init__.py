"""Runners: the torch side of a stage (what a stage factory returns), one module per runner kind."""

from __future__ import annotations

from voice_server.runners.ar_config import DecoderRunnerConfig
from voice_server.runners.ar_runner import DecoderRunner

__all__ = ["DecoderRunner", "DecoderRunnerConfig"]
