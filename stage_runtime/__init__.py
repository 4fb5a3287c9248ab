"""stage-runtime: pipeline-parallel LLM inference on trio with per-stage activation caches.

The top level holds what a pipeline's user touches: opening a pipeline, its configuration, its
frames, models, placements and errors. The rest lives in namespaces of its own:

- :mod:`stage_runtime.cache` (one stage's cache and its indexes; :mod:`stage_runtime.cache.paged`
  for the paged index's types), :mod:`stage_runtime.cache_actor` (the actor owning it and its
  messages), :mod:`stage_runtime.integration` (the upstream's seed-parity facade),
  :mod:`stage_runtime.identity` and :mod:`stage_runtime.tenancy` (prefix keys);
- :mod:`stage_runtime.sim` (workloads, trace replay, the clairvoyant ceiling);
- :mod:`stage_runtime.server` (the HTTP server) and :mod:`stage_runtime.testing` (fixtures).

Names that used to be exported here still resolve, with a :class:`DeprecationWarning` naming
their module.
"""

from __future__ import annotations

import importlib
import warnings
from typing import Any

from stage_runtime.config import CacheIndex, CacheMode, KvCacheConfig, PageEviction, StageConfig
from stage_runtime.errors import (
    ConfigError,
    FrameError,
    PipelineStoppedError,
    StageFailedError,
    StageRuntimeError,
    TraceFormatError,
)
from stage_runtime.frames import ActivationDesc, ActivationDType, ActivationFrame, ActivationLayout
from stage_runtime.models import (
    ModelFactory,
    StageModel,
    reference_model_factory,
    virtual_model_factory,
)
from stage_runtime.pipeline import (
    Pipeline,
    PipelineStats,
    PrefillResult,
    load_model,
    load_topology,
    open_pipeline,
    validate_topology,
)
from stage_runtime.placement import LocalPlacement, RayPlacement
from stage_runtime.stage import StagePrefillReport

__all__ = [
    "open_pipeline",
    "Pipeline",
    "PrefillResult",
    "PipelineStats",
    "StagePrefillReport",
    "load_topology",
    "load_model",
    "validate_topology",
    "StageConfig",
    "KvCacheConfig",
    "CacheMode",
    "CacheIndex",
    "PageEviction",
    "ActivationFrame",
    "ActivationDesc",
    "ActivationDType",
    "ActivationLayout",
    "StageModel",
    "ModelFactory",
    "reference_model_factory",
    "virtual_model_factory",
    "LocalPlacement",
    "RayPlacement",
    "StageRuntimeError",
    "ConfigError",
    "FrameError",
    "StageFailedError",
    "PipelineStoppedError",
    "TraceFormatError",
]

# Names exported here before the API was tiered (issue 24) -> the module that holds them now.
_MOVED: dict[str, str] = {
    "ActivationIndex": "stage_runtime.cache",
    "ActivationRecordSummary": "stage_runtime.integration",
    "ActivationRestore": "stage_runtime.cache",
    "CacheAccounting": "stage_runtime.accounting",
    "CacheActor": "stage_runtime.cache_actor",
    "CacheLookup": "stage_runtime.cache",
    "CacheMessage": "stage_runtime.cache_actor",
    "CachePayload": "stage_runtime.config",
    "CacheRecordOutcome": "stage_runtime.cache",
    "CacheStats": "stage_runtime.cache_actor",
    "CacheStatsRequest": "stage_runtime.cache_actor",
    "CandidatePolicy": "stage_runtime.policy",
    "CausalMixModel": "stage_runtime.models",
    "ClearCache": "stage_runtime.cache_actor",
    "EntryKind": "stage_runtime.cache.paged",
    "EvictedEntry": "stage_runtime.cache",
    "EvictedPage": "stage_runtime.cache.paged",
    "EvictedPages": "stage_runtime.cache.paged",
    "EvictionReason": "stage_runtime.cache",
    "FlashAttention": "stage_runtime.config",
    "KvStageIntegration": "stage_runtime.integration",
    "LadderIndex": "stage_runtime.cache",
    "LadderStageIntegration": "stage_runtime.integration",
    "LoadMode": "stage_runtime.config",
    "MessageBase": "stage_runtime.config",
    "MissReason": "stage_runtime.accounting",
    "PageChain": "stage_runtime.cache.paged",
    "PageIdentity": "stage_runtime.integration",
    "PagedActivationIndex": "stage_runtime.cache.paged",
    "PagedActivationRestore": "stage_runtime.integration",
    "PagedIndex": "stage_runtime.cache",
    "PagedIndexStats": "stage_runtime.cache.paged",
    "PagedLookup": "stage_runtime.cache.paged",
    "PagedRecordOutcome": "stage_runtime.cache.paged",
    "PagedRestore": "stage_runtime.cache.paged",
    "PagedStageIntegration": "stage_runtime.integration",
    "PlatformIdentity": "stage_runtime.identity",
    "PrefillKvIdentity": "stage_runtime.integration",
    "RUNTIME_ABI_VERSION": "stage_runtime.identity",
    "RecordActivation": "stage_runtime.cache_actor",
    "ResidentActivationCache": "stage_runtime.cache",
    "ResidentActivationRecord": "stage_runtime.integration",
    "ResidentActivationRestore": "stage_runtime.integration",
    "ResidentCacheStats": "stage_runtime.cache",
    "RestoreActivation": "stage_runtime.cache_actor",
    "RestoreActivationPages": "stage_runtime.cache_actor",
    "SCHEMA_VERSION": "stage_runtime.config",
    "StageCache": "stage_runtime.cache",
    "StageStats": "stage_runtime.stage",
    "TokenArray": "stage_runtime.identity",
    "VirtualStageModel": "stage_runtime.models",
    "activation_page_id": "stage_runtime.identity",
    "as_token_array": "stage_runtime.identity",
    "build_index": "stage_runtime.cache",
    "derive_max_resident_tokens": "stage_runtime.policy",
    "effective_cache_payload": "stage_runtime.integration",
    "kill_switch_engaged": "stage_runtime.config",
    "load_placement": "stage_runtime.pipeline",
    "page_chain": "stage_runtime.cache.paged",
    "page_id": "stage_runtime.identity",
    "paged_namespace": "stage_runtime.tenancy",
    "prefix_hash": "stage_runtime.identity",
    "prefix_hashes": "stage_runtime.identity",
    "prefix_namespace_hash": "stage_runtime.identity",
    "round_half_away_from_zero": "stage_runtime.policy",
    "salted_prefix_hash": "stage_runtime.tenancy",
    "salted_prefix_hashes": "stage_runtime.tenancy",
    "summarize_records": "stage_runtime.integration",
}


def __getattr__(name: str) -> Any:
    """Resolve a name that moved to a sub-module, warning where it lives now."""
    module = _MOVED.get(name)
    if module is None:
        msg = f"module 'stage_runtime' has no attribute {name!r}"
        raise AttributeError(msg)
    warnings.warn(
        f"stage_runtime.{name} is deprecated: import it from {module}",
        DeprecationWarning,
        stacklevel=2,
    )
    return getattr(importlib.import_module(module), name)


def __dir__() -> list[str]:
    return sorted([*globals(), *_MOVED])
