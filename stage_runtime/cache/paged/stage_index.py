"""The paged index of a stage cache (issue 6): pages shared across prompts.

A :class:`PagedIndex` holds a :class:`~stage_runtime.cache.paged.PagedActivationIndex` and turns
prompts and frames into its chains and payloads. Differences a caller can see from the ladder:

- a restore returns the longest cached run of pages (any page boundary, not only grid lengths),
  plus the tail when the whole prompt matches; its ``identity.identity.prefix_hash`` is a digest
  of the chained page key of the restored prefix (``"blake3:"`` + 64 hex), not the upstream's
  flat prefix hash;
- a record returns one :class:`~stage_runtime.cache.results.ResidentActivationRecord` per call
  whose ``token_count`` is the prefix now covered and whose ``payload_bytes`` are the bytes newly
  stored (pages another prompt already stored cost nothing);
- frames that are not token-major or carry flags are stored whole, restorable only at their exact
  length, as the ladder does for them.
"""

from __future__ import annotations

import operator

import attrs
import numpy as np

from stage_runtime.accounting import CacheAccounting, MissReason
from stage_runtime.cache.paged.chains import PageChain, key_digest
from stage_runtime.cache.paged.index import PagedActivationIndex
from stage_runtime.cache.prompt import Prompt
from stage_runtime.cache.resident import EvictedEntry, ResidentCacheStats
from stage_runtime.cache.results import (
    ActivationRestore,
    ResidentActivationRecord,
)
from stage_runtime.config import KvCacheConfig
from stage_runtime.errors import FrameError
from stage_runtime.frames import (
    ActivationDesc,
    ActivationFrame,
    ActivationLayout,
    _desc_with_counts,
)
from stage_runtime.tenancy import paged_namespace

__all__ = ["PagedIndex"]

_ROW_FIELDS = operator.attrgetter(
    *(
        f.name
        for f in attrs.fields(ActivationDesc)
        if f.name not in {"token_count", "payload_bytes"}
    )
)
"""What an ActivationDesc says about its rows besides how many there are."""
_ROW_METAS = 64
"""Distinct row descriptions a paged index keeps one shared object of."""


class PagedIndex:
    """The paged index of one stage cache. Single owner, synchronous.

    Args:
        cache_config: The bounds (``max_entries`` pages, ``max_bytes``), ``min_tokens``, the
            page size (``effective_page_tokens``) and the eviction policy.
    """

    kind = "paged"

    def __init__(self, cache_config: KvCacheConfig) -> None:
        self.index = PagedActivationIndex(
            page_tokens=cache_config.effective_page_tokens,
            max_entries=cache_config.max_entries,
            max_bytes=cache_config.max_bytes,
            min_tokens=cache_config.min_tokens,
            eviction=cache_config.page_eviction,
        )
        """The pages, bounded by the config's ``max_entries`` and ``max_bytes``."""
        self.min_tokens = cache_config.min_tokens
        self.last_miss_reason: MissReason | None = None
        self._chain_memo: PageChain | None = None
        self._namespace_memo: tuple[tuple[object, ...], bytes, str] | None = None
        """The last namespace and label computed, with what they were computed from."""
        self._row_metas: dict[tuple[object, ...], ActivationDesc] = {}
        """One shared ``meta`` object per row description: pages compare their ``meta`` on
        every restore and re-record, and the same object compares at once."""

    def lookup_candidates(self, token_count: int) -> int:
        """One: a paged restore walks the prompt's page chain once, whatever its length."""
        return 1 if token_count > 0 else 0

    def restore(self, prompt: Prompt) -> ActivationRestore | None:
        """The longest cached run of the prompt's pages, page by page without copying.

        The run starts at token 0 and ends at the first missing or invalid page; the tail entry
        joins when the whole prompt matches. Runs shorter than ``min_tokens`` are misses. A hit
        refreshes the recency of every page it used.
        """
        lookup = self.index.restore(self._chain(prompt))
        self.last_miss_reason = lookup.miss_reason
        found = lookup.restore
        if found is None:
            return None
        meta = found.meta
        if not isinstance(meta, ActivationDesc):  # pragma: no cover - only this class records
            msg = f"cached page meta must be an ActivationDesc, got {type(meta).__name__}"
            raise FrameError(msg)
        count = found.token_count
        payload_bytes = found.payload_bytes
        return ActivationRestore(
            identity_of=(
                prompt.config,
                prompt.base,
                prompt.token_start,
                prompt.tokens,
                count,
                "blake3:" + key_digest(found.last_key).hex(),
            ),
            page_id=found.last_name,
            token_count=count,
            payload_bytes=payload_bytes,
            entries=found.entries,
            desc=_desc_with_counts(meta, count, payload_bytes),  # (counts of stored pages)
            source=found,
        )

    def record(self, prompt: Prompt, frame: ActivationFrame) -> list[ResidentActivationRecord]:
        """Store ``frame``'s rows as pages (shared pages are only refreshed).

        Nothing is stored for fewer than ``min_tokens`` tokens, an empty payload, or a frame
        whose counts disagree with the prompt or its payload. Frames that are not token-major or
        carry flags are stored whole (exact length only).

        Returns:
            One record for the call (``token_count`` = tokens now covered from the start,
            ``payload_bytes`` = bytes newly stored, with the evictions it caused), or ``[]``.
        """
        n = prompt.n
        if n < self.min_tokens or frame.payload.size == 0:
            return []
        desc = frame.desc
        if desc.token_count != n or desc.payload_bytes != frame.payload.size:
            return []
        chain = self._chain(prompt)
        outcome = self.index.record(
            chain,
            frame.payload,
            meta=self._row_meta(desc),
            token_major=desc.layout is ActivationLayout.TOKEN_MAJOR and desc.flags == 0,
        )
        evicted = outcome.evicted
        if outcome.covered_tokens == 0 and not evicted:
            return []
        return [
            ResidentActivationRecord(
                page_id=outcome.last_entry or chain.label,
                token_count=outcome.covered_tokens,
                payload_bytes=outcome.stored_bytes,
                evicted_entries=len(evicted),
                evicted_bytes=evicted.payload_bytes,
                entries=outcome.entries,
                resident_bytes=outcome.resident_bytes,
                evicted=evicted,
            )
        ]

    def clear(self) -> tuple[EvictedEntry, ...]:
        """Drop every page; returns them with reason ``"cleared"``."""
        self._chain_memo = None
        return self.index.clear()

    def statistics(self) -> ResidentCacheStats:
        """The index's counters in the ladder's shape (one lookup per restore call)."""
        s = self.index.statistics()
        return ResidentCacheStats(
            entries=s.entries,
            resident_bytes=s.resident_bytes,
            lookups=s.lookups,
            hits=s.hits,
            misses=s.misses,
            records=s.records,
            evictions=s.evictions,
            evicted_bytes=s.evicted_bytes,
        )

    def accounting(self) -> CacheAccounting:
        """Hits, misses by reason, restored tokens and residency vs unique-prefix bytes."""
        s = self.index.statistics()
        return CacheAccounting(
            index="paged",
            lookups=s.lookups,
            hits=s.hits,
            misses_never_seen=s.misses_never_seen,
            misses_evicted=s.misses_evicted,
            misses_rejected=s.misses_rejected,
            restored_tokens=s.restored_tokens,
            entries=s.entries,
            resident_bytes=s.resident_bytes,
            unique_prefix_bytes=self.index.unique_prefix_bytes(),
            evictions=s.evictions,
            evicted_bytes=s.evicted_bytes,
        )

    # ------------------------------------------------------------------------------- helpers

    def _chain(self, prompt: Prompt) -> PageChain:
        """The prompt's page keys, reusing the previous call's when it was the same prompt."""
        namespace, label = self._namespace(prompt)
        memo = self._chain_memo
        tokens = prompt.tokens
        if (
            memo is not None
            and memo.namespace == namespace
            and (
                memo.tokens is tokens
                or (memo.tokens.size == tokens.size and bool(np.array_equal(memo.tokens, tokens)))
            )
        ):
            return memo
        chain = self.index.chain(namespace, tokens, label=label)
        self._chain_memo = chain
        return chain

    def _namespace(self, prompt: Prompt) -> tuple[bytes, str]:
        """:func:`paged_namespace` and the entry label, reused while their inputs repeat."""
        config, base = prompt.config, prompt.base
        inputs = (config, *prompt.group)
        memo = self._namespace_memo
        if memo is not None and memo[0] == inputs:
            return memo[1], memo[2]
        namespace = paged_namespace(config, prompt.token_start, base, prompt.width)
        label = f"act:{config.stage_id}:{prompt.token_start}:{config.layer_start}:w{prompt.width}"
        self._namespace_memo = (inputs, namespace, label)
        return namespace, label

    def _row_meta(self, desc: ActivationDesc) -> ActivationDesc:
        """``desc`` without its counts: the ``meta`` its pages are recorded with (shared)."""
        fields = _ROW_FIELDS(desc)
        meta = self._row_metas.get(fields)
        if meta is None:
            if len(self._row_metas) >= _ROW_METAS:
                self._row_metas.clear()
            meta = attrs.evolve(desc, token_count=0, payload_bytes=0)
            self._row_metas[fields] = meta
        return meta
