"""stage-runtime: pipeline-parallel LLM inference on trio with per-stage activation caches."""

from __future__ import annotations

from stage_runtime.errors import (
    ConfigError,
    FrameError,
    StageFailedError,
    StageRuntimeError,
    TraceFormatError,
)

__all__ = [
    "ConfigError",
    "FrameError",
    "StageFailedError",
    "StageRuntimeError",
    "TraceFormatError",
]
