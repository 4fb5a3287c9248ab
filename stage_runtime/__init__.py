"""stage-runtime: pipeline-parallel LLM inference on trio with per-stage activation caches."""

from __future__ import annotations

from stage_runtime.accounting import CacheAccounting, MissReason
from stage_runtime.config import (
    SCHEMA_VERSION,
    CacheIndex,
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
from stage_runtime.paged import (
    EvictedPage,
    PageChain,
    PagedActivationIndex,
    PagedIndexStats,
    PagedLookup,
    PagedRecordOutcome,
    PagedRestore,
    page_chain,
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
    "CacheMode",
    "CandidatePolicy",
    "CachePayload",
    "ConfigError",
    "FlashAttention",
    "FrameError",
    "KvCacheConfig",
    "LoadMode",
    "MessageBase",
    "PlatformIdentity",
    "StageConfig",
    "StageFailedError",
    "StageRuntimeError",
    "TokenArray",
    "TraceFormatError",
    "activation_page_id",
    "as_token_array",
    "derive_max_resident_tokens",
    "kill_switch_engaged",
    "page_id",
    "prefix_hash",
    "prefix_hashes",
    "prefix_namespace_hash",
    "round_half_away_from_zero",
    # paged index (issue 6)
    "CacheAccounting",
    "CacheIndex",
    "EvictedPage",
    "MissReason",
    "PageChain",
    "PagedActivationIndex",
    "PagedIndexStats",
    "PagedLookup",
    "PagedRecordOutcome",
    "PagedRestore",
    "page_chain",
]
