"""stage-runtime: pipeline-parallel LLM inference on trio with per-stage activation caches."""

from __future__ import annotations

from stage_runtime.config import (
    SCHEMA_VERSION,
    CacheMode,
    CachePayload,
    FlashAttention,
    KvCacheConfig,
    LoadMode,
    MessageBase,
    StageConfig,
    kill_switch_engaged,
)
from stage_runtime.errors import (
    ConfigError,
    FrameError,
    StageFailedError,
    StageRuntimeError,
    TraceFormatError,
)
from stage_runtime.frames import (
    ActivationDesc,
    ActivationDType,
    ActivationFrame,
    ActivationLayout,
)

__all__ = [
    "SCHEMA_VERSION",
    "ActivationDType",
    "ActivationDesc",
    "ActivationFrame",
    "ActivationLayout",
    "CacheMode",
    "CachePayload",
    "ConfigError",
    "FlashAttention",
    "FrameError",
    "KvCacheConfig",
    "LoadMode",
    "MessageBase",
    "StageConfig",
    "StageFailedError",
    "StageRuntimeError",
    "TraceFormatError",
    "kill_switch_engaged",
]
