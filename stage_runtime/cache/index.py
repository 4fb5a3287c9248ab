"""What a stage cache needs of an index: the :class:`ActivationIndex` protocol.

Two indexes implement it: :class:`~stage_runtime.cache.ladder.LadderIndex` (the upstream's
record ladder over a resident LRU) and :class:`~stage_runtime.cache.paged.PagedIndex`
(pages shared across prompts). A :class:`~stage_runtime.cache.stage_cache.StageCache` owns one
and validates every argument before it reaches the index, so an index never sees bad input.
"""

from __future__ import annotations

from typing import Protocol

from stage_runtime.accounting import CacheAccounting, MissReason
from stage_runtime.cache.prompt import Prompt
from stage_runtime.cache.resident import EvictedEntry, ResidentCacheStats
from stage_runtime.cache.results import ActivationRestore, ResidentActivationRecord
from stage_runtime.frames import ActivationFrame

__all__ = ["ActivationIndex"]


class ActivationIndex(Protocol):
    """An index of one stage's cached activations (named apart from the ``CacheIndex`` enum
    of the configuration, which picks one)."""

    @property
    def kind(self) -> str:
        """``"ladder"`` or ``"paged"``."""
        ...

    @property
    def last_miss_reason(self) -> MissReason | None:
        """Why the latest restore restored nothing; None after a hit."""
        ...

    def lookup_candidates(self, token_count: int) -> int:
        """Lookups one restore of ``token_count`` tokens counts (for the miss event)."""
        ...

    def restore(self, prompt: Prompt) -> ActivationRestore | None:
        """The longest cached prefix of a prompt (which has tokens), or None."""
        ...

    def record(self, prompt: Prompt, frame: ActivationFrame) -> list[ResidentActivationRecord]:
        """Store the prompt's output ``frame`` (covering all its tokens); what was stored."""
        ...

    def clear(self) -> tuple[EvictedEntry, ...]:
        """Drop every entry; returns them with reason ``"cleared"``."""
        ...

    def statistics(self) -> ResidentCacheStats:
        """The index's counters."""
        ...

    def accounting(self) -> CacheAccounting:
        """Hits, misses by reason, restored tokens, resident vs unique-prefix bytes."""
        ...
