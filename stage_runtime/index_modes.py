"""The two index modes of :class:`~stage_runtime.integration.KvStageIntegration` (issue 6).

``KvStageIntegration.from_config`` returns one of these, chosen by ``kv_cache.index``:

- :class:`LadderStageIntegration` (``"ladder"``, the default): the upstream's behaviour, exactly
  (the base class does the work), plus accounting: misses by reason, restored tokens and the
  unique-prefix footprint of the resident entries;
- :class:`PagedStageIntegration` (``"paged"``): a :class:`~stage_runtime.paged.PagedActivationIndex`
  replaces the ladder's per-length entries behind the same API and result types, so the cache
  actor, the stage and the pipeline do not know which index they talk to.

Differences a caller of the paged mode can see:

- a restore returns the longest cached run of pages (any page boundary, not only grid lengths),
  plus the tail when the whole prompt matches; its ``identity.prefix_hash`` is the chained page
  key of the restored prefix (``"blake3:"`` + 64 hex), not the upstream's flat prefix hash;
- a record returns one :class:`~stage_runtime.integration.ResidentActivationRecord` per call
  whose ``token_count`` is the prefix now covered and whose ``payload_bytes`` are the bytes newly
  stored (pages another prompt already stored cost nothing);
- frames that are not token-major or carry flags are stored whole, restorable only at their exact
  length, as the ladder does for them.
"""

from __future__ import annotations

import operator
from collections.abc import Sequence

import attrs
import numpy as np
import numpy.typing as npt

from stage_runtime.accounting import CacheAccounting
from stage_runtime.cache import EvictedEntry, ResidentCacheStats
from stage_runtime.config import MessageBase, PageEviction, StageConfig
from stage_runtime.errors import FrameError
from stage_runtime.frames import ActivationDesc, ActivationFrame, ActivationLayout
from stage_runtime.identity import TokenArray
from stage_runtime.integration import (
    KvStageIntegration,
    PrefillKvIdentity,
    ResidentActivationRecord,
    ResidentActivationRestore,
    _check_width,
)
from stage_runtime.paged import (
    PageChain,
    PagedActivationIndex,
    PagedRestore,
)
from stage_runtime.tenancy import paged_namespace

__all__ = ["LadderStageIntegration", "PagedActivationRestore", "PagedStageIntegration"]


@attrs.define(eq=False)
class LadderStageIntegration(KvStageIntegration):
    """The upstream ladder index, plus the accounting both modes report.

    The work is the :class:`~stage_runtime.cache.ladder.LadderIndex`'s; this class names the
    ladder mode of :meth:`KvStageIntegration.from_config`.
    """


_NamespaceInputs = tuple[StageConfig, int, str | None, str | None, int]


@attrs.frozen(kw_only=True, eq=False)
class PagedActivationRestore:
    """A paged hit in streaming form: zero-copy page frames, or one frame assembled on demand."""

    identity: PrefillKvIdentity
    """Identity of the restored prefix (its prefix hash is the chained page key)."""
    page_id: str
    """Name of the last entry used."""
    token_count: int
    """Tokens restored."""
    payload_bytes: int
    """Bytes of the restored prefix."""
    entries: int
    """Entries resident at restore time."""
    desc: ActivationDesc
    """Descriptor of the whole restored prefix."""
    source: PagedRestore
    """The index's hit: the cached page payloads (read-only views) and their token counts."""

    def pages(self) -> tuple[ActivationFrame, ...]:
        """The pages in token order, one frame each, viewing the cached rows (never copied)."""
        return tuple(
            ActivationFrame(
                desc=attrs.evolve(self.desc, token_count=count, payload_bytes=int(payload.size)),
                payload=payload,
            )
            for count, payload in zip(self.source.page_token_counts, self.source.pages, strict=True)
        )

    def frame(self) -> ActivationFrame:
        """The whole prefix as one frame: at most one copy (none for one page or virtual rows)."""
        return ActivationFrame(desc=self.desc, payload=self.source.payload())

    def to_restore(self) -> ResidentActivationRestore:
        """The same hit as the integration's usual result (assembling the frame)."""
        return ResidentActivationRestore(
            identity=self.identity,
            page_id=self.page_id,
            token_count=self.token_count,
            payload_bytes=self.payload_bytes,
            entries=self.entries,
            frame=self.frame(),
        )


_ROW_FIELDS = operator.attrgetter(
    *(
        f.name
        for f in attrs.fields(ActivationDesc)
        if f.name not in {"token_count", "payload_bytes"}
    )
)
"""What an ActivationDesc says about its rows besides how many there are."""
_ROW_METAS = 64
"""Distinct row descriptions a paged integration keeps one shared object of."""


@attrs.define(eq=False)
class PagedStageIntegration(KvStageIntegration):
    """A stage's activation cache in paged mode; same API as the ladder integration.

    The inherited ``cache`` (the ladder's store) stays empty; ``index`` holds the pages.
    """

    index: PagedActivationIndex = attrs.field(init=False)
    """The pages, bounded by the config's ``max_entries`` and ``max_bytes``."""

    _chain_memo: PageChain | None = attrs.field(default=None, init=False, repr=False)
    _namespace_memo: tuple[_NamespaceInputs, bytes, str] | None = attrs.field(
        default=None, init=False, repr=False
    )
    """The last namespace and label computed, with what they were computed from."""
    _row_metas: dict[tuple[object, ...], ActivationDesc] = attrs.field(
        factory=dict, init=False, repr=False
    )
    """One shared ``meta`` object per row description: pages compare their ``meta`` on every
    restore and re-record, and the same object compares at once."""

    def __attrs_post_init__(self) -> None:
        cfg = self.cache_config
        self.index = PagedActivationIndex(
            page_tokens=cfg.effective_page_tokens,
            max_entries=cfg.max_entries,
            max_bytes=cfg.max_bytes,
            min_tokens=cfg.min_tokens,
            eviction="reuse" if cfg.page_eviction is PageEviction.REUSE else "lru",
        )

    # ----------------------------------------------------------------------------------------
    # restore and record

    def restore_resident_activation(
        self,
        config: StageConfig,
        base: MessageBase,
        token_start: int,
        tokens: Sequence[int] | npt.NDArray[np.integer],
        activation_width: int,
    ) -> ResidentActivationRestore | None:
        """The longest cached run of pages of ``tokens`` as one frame, or None.

        See :meth:`restore_resident_pages` for the rules; this assembles the pages (at most one
        copy).

        Raises:
            ConfigError: a bad argument; the cache is left unchanged.
        """
        found = self.restore_resident_pages(config, base, token_start, tokens, activation_width)
        return None if found is None else found.to_restore()

    def lookup_candidates(self, token_count: int) -> int:
        """One: a paged restore walks the prompt's page chain once, whatever its length."""
        return 1 if token_count > 0 else 0

    def restore_resident_pages(
        self,
        config: StageConfig,
        base: MessageBase,
        token_start: int,
        tokens: Sequence[int] | npt.NDArray[np.integer],
        activation_width: int,
    ) -> PagedActivationRestore | None:
        """The longest cached run of pages of ``tokens``, page by page without copying.

        The run starts at token 0 and ends at the first missing or invalid page; the tail entry
        joins when the whole prompt matches. Runs shorter than ``min_tokens`` are misses. A hit
        refreshes the recency of every page it used.

        Raises:
            ConfigError: a bad argument; the cache is left unchanged.
        """
        array = self._check(config, base, token_start, tokens)
        width = _check_width(activation_width)
        if not self.should_lookup() or array.size == 0:
            return None
        chain = self._chain(config, base, token_start, array, width)
        lookup = self.index.restore(chain)
        self.last_miss_reason = lookup.miss_reason
        found = lookup.restore
        if found is None:
            return None
        meta = found.meta
        if not isinstance(meta, ActivationDesc):  # pragma: no cover - only this class records
            msg = f"cached page meta must be an ActivationDesc, got {type(meta).__name__}"
            raise FrameError(msg)
        count = found.token_count
        hash_ = "blake3:" + found.last_key.hex()
        return PagedActivationRestore(
            identity=self._identity(config, base, token_start, array, count, hash_),
            page_id=found.keys[-1],
            token_count=count,
            payload_bytes=found.payload_bytes,
            entries=found.entries,
            desc=attrs.evolve(meta, token_count=count, payload_bytes=found.payload_bytes),
            source=found,
        )

    def record_resident_activation(
        self,
        config: StageConfig,
        base: MessageBase,
        token_start: int,
        tokens: Sequence[int] | npt.NDArray[np.integer],
        activation_width: int,
        frame: ActivationFrame,
    ) -> list[ResidentActivationRecord]:
        """Store ``frame``'s rows as pages (shared pages are only refreshed).

        Nothing is stored when the mode does not record, there are no tokens, fewer than
        ``min_tokens``, an empty payload, or a frame whose token count is not ``len(tokens)``.
        Frames that are not token-major or carry flags are stored whole (exact length only).

        Returns:
            One record for the call (``token_count`` = tokens now covered from the start,
            ``payload_bytes`` = bytes newly stored, with the evictions it caused), or ``[]``.

        Raises:
            ConfigError: a bad argument; the cache is left unchanged.
            FrameError: ``frame`` is not an ActivationFrame; the cache is left unchanged.
        """
        array = self._check(config, base, token_start, tokens)
        width = _check_width(activation_width)
        if not isinstance(frame, ActivationFrame):
            msg = f"frame must be an ActivationFrame, got {type(frame).__name__}"
            raise FrameError(msg)
        n = int(array.size)
        if not self.should_record() or n == 0:
            return []
        if n < self.policy.min_tokens or frame.payload.size == 0:
            return []
        if frame.desc.token_count != n or frame.desc.payload_bytes != frame.payload.size:
            return []
        chain = self._chain(config, base, token_start, array, width)
        desc = frame.desc
        token_major = desc.layout is ActivationLayout.TOKEN_MAJOR and desc.flags == 0
        outcome = self.index.record(
            chain,
            frame.payload,
            meta=self._row_meta(desc),
            token_major=token_major,
        )
        if outcome.covered_tokens == 0 and not outcome.evicted:
            return []
        evicted = outcome.evicted
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

    def clear(self) -> tuple[EvictedEntry, ...]:
        """Drop every page; returns them with reason ``"cleared"``."""
        self._chain_memo = None
        return self.index.clear()

    def stats(self) -> ResidentCacheStats:
        """The index's counters in the ladder's shape (one lookup per restore call)."""
        s = self.index.stats()
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
        s = self.index.stats()
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

    # ----------------------------------------------------------------------------------------
    # helpers

    def _chain(
        self,
        config: StageConfig,
        base: MessageBase,
        token_start: int,
        array: TokenArray,
        width: int,
    ) -> PageChain:
        """The prompt's page keys, reusing the previous call's when it was the same prompt."""
        namespace, label = self._namespace(config, token_start, base, width)
        memo = self._chain_memo
        if (
            memo is not None
            and memo.namespace == namespace
            and memo.tokens.size == array.size
            and bool(np.array_equal(memo.tokens, array))
        ):
            return memo
        chain = self.index.chain(namespace, array, label=label)
        self._chain_memo = chain
        return chain

    def _namespace(
        self, config: StageConfig, token_start: int, base: MessageBase, width: int
    ) -> tuple[bytes, str]:
        """:func:`paged_namespace` and the entry label, reused while their inputs repeat."""
        inputs = (config, token_start, base.chat_template_id, base.cache_salt, width)
        memo = self._namespace_memo
        if memo is not None and memo[0] == inputs:
            return memo[1], memo[2]
        namespace = paged_namespace(config, token_start, base, width)
        label = f"act:{config.stage_id}:{token_start}:{config.layer_start}:w{width}"
        self._namespace_memo = (inputs, namespace, label)
        return namespace, label
