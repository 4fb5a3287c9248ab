"""A stage's activation cache: the cache a stage owns, its two indexes and what they return.

- :class:`StageCache`: one stage's cache, its settings validated once, owning one index;
- :class:`ActivationIndex`: what an index provides; :class:`LadderIndex` (the upstream's
  record ladder over a :class:`ResidentActivationCache`) and :class:`PagedIndex` (pages shared
  across prompts) implement it;
- :class:`ActivationRestore`: a hit of either index.

Plain single-owner state: no locks, no trio. A cache actor owns one and is the only caller.
"""

from stage_runtime.cache.index import ActivationIndex
from stage_runtime.cache.ladder import LadderIndex
from stage_runtime.cache.paged.stage_index import PagedIndex
from stage_runtime.cache.resident import (
    CacheLookup,
    CacheRecordOutcome,
    EvictedEntry,
    EvictionReason,
    ResidentActivationCache,
    ResidentCacheStats,
)
from stage_runtime.cache.results import ActivationRestore
from stage_runtime.cache.stage_cache import StageCache, build_index

__all__ = [
    "ActivationIndex",
    "ActivationRestore",
    "CacheLookup",
    "CacheRecordOutcome",
    "EvictedEntry",
    "EvictionReason",
    "LadderIndex",
    "PagedIndex",
    "ResidentActivationCache",
    "ResidentCacheStats",
    "StageCache",
    "build_index",
]
