"""A stage's activation cache: the resident store, the indexes and the cache a stage owns.

Plain single-owner state: no locks, no trio. A cache actor owns one and is the only caller.
"""

from stage_runtime.cache.resident import (
    CacheLookup,
    CacheRecordOutcome,
    EvictedEntry,
    EvictionReason,
    ResidentActivationCache,
    ResidentCacheStats,
)

__all__ = [
    "CacheLookup",
    "CacheRecordOutcome",
    "EvictedEntry",
    "EvictionReason",
    "ResidentActivationCache",
    "ResidentCacheStats",
]
