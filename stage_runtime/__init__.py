"""stage-runtime: pipeline-parallel LLM inference on trio with per-stage activation caches."""

from __future__ import annotations

from stage_runtime.cache import (
    CacheLookup,
    CacheRecordOutcome,
    EvictedEntry,
    EvictionReason,
    ResidentActivationCache,
    ResidentCacheStats,
)
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
from stage_runtime.identity import (
    RUNTIME_ABI_VERSION,
    PlatformIdentity,
    TokenArray,
    activation_page_id,
    as_token_array,
    page_id,
    prefix_hash,
    prefix_hashes,
    prefix_namespace_hash,
)
from stage_runtime.integration import (
    ActivationRecordSummary,
    KvStageIntegration,
    PageIdentity,
    PrefillKvIdentity,
    ResidentActivationRecord,
    ResidentActivationRestore,
    effective_cache_payload,
    summarize_records,
)
from stage_runtime.policy import (
    CandidatePolicy,
    derive_max_resident_tokens,
    round_half_away_from_zero,
)

__all__ = [
    "RUNTIME_ABI_VERSION",
    "SCHEMA_VERSION",
    "ActivationDType",
    "ActivationDesc",
    "ActivationFrame",
    "ActivationLayout",
    "ActivationRecordSummary",
    "CacheLookup",
    "CacheMode",
    "CachePayload",
    "CacheRecordOutcome",
    "CandidatePolicy",
    "ConfigError",
    "EvictedEntry",
    "EvictionReason",
    "FlashAttention",
    "FrameError",
    "KvCacheConfig",
    "KvStageIntegration",
    "LoadMode",
    "MessageBase",
    "PageIdentity",
    "PlatformIdentity",
    "PrefillKvIdentity",
    "ResidentActivationCache",
    "ResidentActivationRecord",
    "ResidentActivationRestore",
    "ResidentCacheStats",
    "StageConfig",
    "StageFailedError",
    "StageRuntimeError",
    "TokenArray",
    "TraceFormatError",
    "activation_page_id",
    "as_token_array",
    "derive_max_resident_tokens",
    "effective_cache_payload",
    "kill_switch_engaged",
    "page_id",
    "prefix_hash",
    "prefix_hashes",
    "prefix_namespace_hash",
    "round_half_away_from_zero",
    "summarize_records",
]
