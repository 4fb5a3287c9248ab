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
from collections.abc import Hashable, Sequence
from typing import Final

import attrs
import numpy as np
import numpy.typing as npt

from stage_runtime.accounting import CacheAccounting, LadderAccounting
from stage_runtime.cache import EvictedEntry, ResidentCacheStats
from stage_runtime.config import MessageBase, PageEviction, StageConfig
from stage_runtime.errors import FrameError
from stage_runtime.frames import ActivationDesc, ActivationFrame, ActivationLayout
from stage_runtime.identity import TokenArray, activation_page_id, as_token_array, page_id
from stage_runtime.integration import (
    KvStageIntegration,
    PrefillKvIdentity,
    ResidentActivationRecord,
    ResidentActivationRestore,
    _check_width,
    activation_key_slot,
)
from stage_runtime.paged import (
    PageChain,
    PagedActivationIndex,
    PagedRestore,
    page_chain,
)
from stage_runtime.tenancy import paged_namespace

__all__ = ["LadderStageIntegration", "PagedActivationRestore", "PagedStageIntegration"]


@attrs.define(eq=False)
class _PendingPrompt:
    """A recorded prompt whose page chain (for the footprint) is computed only when asked."""

    namespace: bytes
    tokens: TokenArray
    """A private read-only copy."""
    page_tokens: int
    _chain: PageChain | None = attrs.field(default=None, init=False)

    def chain(self) -> PageChain:
        if self._chain is None:
            self._chain = page_chain(self.namespace, self.tokens, page_tokens=self.page_tokens)
        return self._chain


@attrs.define(eq=False)
class LadderStageIntegration(KvStageIntegration):
    """The upstream ladder index, unchanged, plus the accounting both modes report.

    Restores and records are the base class's; this wraps them to count hits, restored tokens
    and misses by reason (``never_seen``, ``evicted`` when a candidate's key was evicted before,
    ``rejected`` when a cached entry failed validation), and to track the unique-prefix footprint
    of the resident entries (pages of ``effective_page_tokens`` keyed like the paged index's).
    """

    _accounting: LadderAccounting = attrs.field(factory=LadderAccounting, init=False, repr=False)
    _footprint_chain: PageChain | None = attrs.field(default=None, init=False, repr=False)
    _extra_counts: list[int] | None = attrs.field(default=None, init=False, repr=False)
    """The candidates the base restore's pass found worth a tombstone check, for its miss path."""
    _slot_keys: dict[tuple[tuple[str, str], int], dict[str, _Fingerprint]] = attrs.field(
        factory=dict, init=False, repr=False
    )
    """Keys recorded through this integration at each ``(start, width)`` and length, with their
    fingerprints, until they are evicted: a restore probes a length only if a resident key there
    has the prompt's fingerprint (or a key there is unknown)."""
    _resident_fingerprints: dict[str, _Fingerprint] = attrs.field(
        factory=dict, init=False, repr=False
    )
    """Fingerprint of each key recorded through this integration, until it leaves the cache."""
    _pending: dict[str, tuple[_PendingPrompt, int, int]] = attrs.field(
        factory=dict, init=False, repr=False
    )
    """Resident keys not yet added to the footprint: (prompt, token count, bytes per token).

    Hashing every recorded prompt into pages for the footprint costs another pass over its
    tokens; it is only needed when :meth:`accounting` is read, and only for entries still
    resident then, so records queue their entries here and evictions drop them unhashed."""
    _namespace_bpt: dict[bytes, int] = attrs.field(factory=dict, init=False, repr=False)
    """Bytes per token first recorded under each footprint namespace."""
    _eager_footprint: bool = attrs.field(default=False, init=False, repr=False)
    """Set once a namespace sees a second bytes-per-token: the footprint's per-group byte width
    then depends on the order of adds and removes, so entries are added as they are recorded."""

    def restore_resident_activation(
        self,
        config: StageConfig,
        base: MessageBase,
        token_start: int,
        tokens: Sequence[int] | npt.NDArray[np.integer],
        activation_width: int,
    ) -> ResidentActivationRestore | None:
        """The base class's restore (spec §5.1), counted.

        Raises:
            ConfigError: a bad argument; the cache is left unchanged.
        """
        found_before = self.cache.hits
        self._extra_counts = None
        array = as_token_array(tokens)  # once: an iterator can be read only once
        found = super().restore_resident_activation(
            config, base, token_start, array, activation_width
        )
        if not self.should_lookup() or array.size == 0:
            return found
        if found is not None:
            self.last_miss_reason = None
            self._accounting.hit(found.token_count)
            return found
        rejected = self.cache.hits > found_before
        self.last_miss_reason = self._accounting.miss(
            self._evicted_candidates(config, base, token_start, array, activation_width),
            rejected=rejected,
        )
        return None

    def record_resident_activation(
        self,
        config: StageConfig,
        base: MessageBase,
        token_start: int,
        tokens: Sequence[int] | npt.NDArray[np.integer],
        activation_width: int,
        frame: ActivationFrame,
    ) -> list[ResidentActivationRecord]:
        """The base class's record (spec §5.2), with evictions and the footprint tracked.

        Raises:
            ConfigError: a bad argument; the cache is left unchanged.
            FrameError: ``frame`` is not an ActivationFrame; the cache is left unchanged.
        """
        array = as_token_array(tokens)  # once: an iterator can be read only once
        records = super().record_resident_activation(
            config, base, token_start, array, activation_width, frame
        )
        if not records:
            return records
        namespace: bytes | None = None
        prompt: _PendingPrompt | None = None
        fingerprints = self._resident_fingerprints
        prints = _fingerprints(array, [record.token_count for record in records], _tenant(base))
        group = (str(token_start), f"w{max(activation_width, 0)}")
        for record, fingerprint in zip(records, prints, strict=True):
            self._evicted(record.evicted)
            key = record.page_id
            if key not in self.cache:
                continue
            fingerprints[key] = fingerprint
            self._slot_keys.setdefault((group, record.token_count), {})[key] = fingerprint
            bpt = max(record.payload_bytes // max(record.token_count, 1), 1)
            if not self._eager_footprint:
                if namespace is None:
                    namespace = paged_namespace(config, token_start, base, activation_width)
                if self._namespace_bpt.setdefault(namespace, bpt) != bpt:
                    self._flush_footprint()
                    self._eager_footprint = True
            if self._eager_footprint:
                chain = self._chain(config, base, token_start, array, activation_width)
                self._accounting.stored(key, chain.segments(record.token_count), bpt)
                continue
            self._accounting.resident(key)
            if key not in self._pending:
                if prompt is None:
                    assert namespace is not None
                    prompt = _PendingPrompt(
                        namespace=namespace,
                        tokens=self._private_tokens(array),
                        page_tokens=self.cache_config.effective_page_tokens,
                    )
                self._pending[key] = (prompt, record.token_count, bpt)
        return records

    def clear(self) -> tuple[EvictedEntry, ...]:
        """Drop every cached frame; returns them with reason ``"cleared"``."""
        cleared = super().clear()
        self._forget_pending(cleared)
        self._resident_fingerprints.clear()
        self._slot_keys.clear()
        self._accounting.evicted(cleared)
        return cleared

    def accounting(self) -> CacheAccounting:
        """Hits, misses by reason, restored tokens and resident vs unique-prefix bytes."""
        self._flush_footprint()
        acc = self._accounting
        stats = self.cache.stats()
        return CacheAccounting(
            index="ladder",
            lookups=acc.lookups,
            hits=acc.hits,
            misses_never_seen=acc.miss_counts["never_seen"],
            misses_evicted=acc.miss_counts["evicted"],
            misses_rejected=acc.miss_counts["rejected"],
            restored_tokens=acc.restored_tokens,
            entries=stats.entries,
            resident_bytes=stats.resident_bytes,
            unique_prefix_bytes=acc.footprint.unique_bytes(),
            evictions=stats.evictions,
            evicted_bytes=stats.evicted_bytes,
        )

    def _private_tokens(self, array: TokenArray) -> TokenArray:
        """A read-only copy of ``array``: the hash memo's when it holds these tokens (it does
        right after a record hashed them), else a new one."""
        memo = self._memo
        if (
            memo is not None
            and memo.tokens is not array
            and memo.tokens.size == array.size
            and not memo.tokens.flags.writeable
        ):
            return memo.tokens
        private = array.copy()
        private.flags.writeable = False
        return private

    def _flush_footprint(self) -> None:
        """Add the queued resident entries to the footprint, in the order they were recorded."""
        footprint = self._accounting.footprint
        for key, (prompt, count, bpt) in self._pending.items():
            footprint.add(key, prompt.chain().segments(count), bpt)
        self._pending.clear()

    def _forget_pending(self, entries: Sequence[EvictedEntry]) -> None:
        if self._pending:
            for entry in entries:
                self._pending.pop(entry.key, None)

    def _evicted(self, entries: Sequence[EvictedEntry]) -> None:
        self._forget_pending(entries)
        fingerprints = self._resident_fingerprints
        # Each tombstone notes its slot and the evicted key's token fingerprint (None: unknown,
        # always check), so that a miss hashes and checks only the candidates whose slot and
        # fingerprint a kept tombstone has: a candidate key with a tombstone has the tokens,
        # hence the fingerprint, of the evicted key. The notes go with their tombstones, so
        # they are bounded as the tombstones are.
        notes: dict[str, tuple[Hashable, ...]] = {}
        for entry in entries:
            fingerprint = fingerprints.pop(entry.key, None)
            slot = activation_key_slot(entry.key)
            if fingerprint is not None and slot is not None:
                keys = self._slot_keys.get(slot)
                if keys is not None:
                    keys.pop(entry.key, None)
                    if not keys:
                        del self._slot_keys[slot]
            if slot is not None:
                group, count = slot
                note = _slot_top(group) | count
                if fingerprint is None:
                    notes[entry.key] = (note, (note, None), _UNKNOWN_FINGERPRINT)
                else:
                    notes[entry.key] = (note, (note, fingerprint))
        self._accounting.evicted(entries, notes)
        if len(fingerprints) > 2 * len(self.cache) + 1024:  # entries dropped behind our back
            for key in [key for key in fingerprints if key not in self.cache]:
                del fingerprints[key]
            for slot, keys in list(self._slot_keys.items()):
                for key in [key for key in keys if key not in self.cache]:
                    del keys[key]
                if not keys:
                    del self._slot_keys[slot]

    def _evicted_candidates(
        self,
        config: StageConfig,
        base: MessageBase,
        token_start: int,
        array: TokenArray,
        width: int,
    ) -> list[str]:
        """Keys of the lookup candidates whose (start, width, length) ever lost an entry."""
        counts = self._extra_counts  # what the restore just computed for this prompt
        self._extra_counts = None
        if counts is None:
            counts = self._restore_extra_counts(
                base,
                token_start,
                width,
                array,
                self.policy.candidate_token_counts(int(array.size)),
            )
        if not counts:
            return []
        wanted = counts
        if self.should_record():  # the record of this prompt comes next: same pass
            wanted = counts + self.policy.record_candidate_token_counts(int(array.size))
        hashes = self._hashes(config, base, token_start, array, wanted)
        return [
            activation_page_id(page_id(config, token_start, c, hashes[c]), width) for c in counts
        ]

    def _filter_probes(
        self, base: MessageBase, token_start: int, width: int, array: TokenArray, probes: list[int]
    ) -> list[int]:
        """Keep the probe lengths where a resident key may be this prompt's.

        A resident key of the prompt's prefix has the prefix's fingerprint; a length whose
        resident keys are all known (recorded here, still resident) with other fingerprints
        cannot hit, and is counted as a miss without hashing it.
        """
        if not probes:
            return probes
        cache, slot_keys = self.cache, self._slot_keys
        group = (str(token_start), f"w{width}")
        tenant = _tenant(base)
        tokens = array.data  # indexing a memoryview gives Python ints (no numpy call per count)
        kept = []
        for count in probes:
            known = slot_keys.get((group, count))
            if known is None:
                kept.append(count)
                continue
            last = count - 1  # _fingerprints(), inlined: only lengths with known keys need one
            fingerprint = (tenant, count, tokens[last], tokens[last >> 1], tokens[last >> 2])
            live = 0
            for key, seen in known.items():
                if key in cache:
                    if seen == fingerprint:
                        break
                    live += 1
            else:
                if live >= cache.indexed_count(group, count):
                    continue  # every resident key there is known and another prefix's
            kept.append(count)
        return kept

    def _restore_extra_counts(
        self, base: MessageBase, token_start: int, width: int, array: TokenArray, counts: list[int]
    ) -> list[int]:
        """The candidates that may have a tombstone: a miss checks their keys.

        Those whose (start, width, length) lost an entry with the same token fingerprint (or an
        unknown one); any other candidate key was never evicted.
        """
        notes = self._accounting.tombstone_notes
        if not notes:
            return []
        top = _slot_top((str(token_start), f"w{max(width, 0)}"))
        tenant = _tenant(base)
        # Only tombstones of keys recorded behind this integration's back have no fingerprint;
        # without one, a (slot, None) note cannot be there and is not looked up.
        unknown = _UNKNOWN_FINGERPRINT in notes
        tokens = array.data  # indexing a memoryview gives Python ints (no numpy call per count)
        out = []
        # One pass: most candidates of a long-running cache have a tombstone in their slot, so
        # the slot test rarely spares a fingerprint; this is _fingerprints() inlined per count.
        for count in counts:
            slot = top | count
            if slot not in notes:
                continue
            last = count - 1
            fingerprint = (tenant, count, tokens[last], tokens[last >> 1], tokens[last >> 2])
            if (slot, fingerprint) in notes or (unknown and (slot, None) in notes):
                out.append(count)
        self._extra_counts = out
        return out

    def _chain(
        self,
        config: StageConfig,
        base: MessageBase,
        token_start: int,
        array: TokenArray,
        width: int,
    ) -> PageChain:
        namespace = paged_namespace(config, token_start, base, width)
        chain = self._footprint_chain
        if (
            chain is not None
            and chain.namespace == namespace
            and chain.tokens.size == array.size
            and bool(np.array_equal(chain.tokens, array))
        ):
            return chain
        chain = page_chain(namespace, array, page_tokens=self.cache_config.effective_page_tokens)
        self._footprint_chain = chain
        return chain


def _slot_top(group: tuple[str, str]) -> int:
    """The high half of a slot's tombstone note, ``_slot_top(group) | count`` (counts are u32):
    a miss tests every candidate's slot, and an int is cheaper to build and hash there than a
    tuple. Two groups may share a top: the notes are a filter, so that only costs a check."""
    return (hash(group) & 0xFFFF_FFFF) << 32


_UNKNOWN_FINGERPRINT: Final = object()
"""The note of every tombstone whose key's fingerprint is unknown (recorded behind the
integration's back): while none is kept, a miss need not look up ``(slot, None)`` notes."""

_Tenant = tuple[str | None, str | None]
_Fingerprint = tuple[_Tenant, int, int, int, int]
_NamespaceInputs = tuple[StageConfig, int, str | None, str | None, int]


def _tenant(base: MessageBase) -> _Tenant:
    """What besides the tokens separates two requests' keys: cache namespace and salt."""
    return (base.chat_template_id, base.cache_salt)


def _fingerprints(array: TokenArray, counts: list[int], tenant: _Tenant) -> list[_Fingerprint]:
    """A cheap fingerprint of each prefix ``array[:count]``: the request's namespace and salt,
    the length and three of its tokens.

    Equal prefixes of one namespace have equal fingerprints; different ones usually differ (a
    filter only: a matching fingerprint is confirmed by the prefix's key). Another tenant's key
    never matches, so a restore never hashes or probes a length because another tenant holds
    the same tokens there: its latency does not tell whether another tenant sent them.
    """
    if len(counts) <= 32:  # a few: index a memoryview (Python ints, no numpy call overhead)
        tokens = array.data
        return [
            (tenant, c, tokens[c - 1], tokens[(c - 1) >> 1], tokens[(c - 1) >> 2]) for c in counts
        ]
    last = np.asarray(counts, dtype=np.intp) - 1
    k = len(counts)
    picks = array[np.concatenate((last, last >> 1, last >> 2))].tolist()
    return [
        (tenant, c, a, b, d)
        for c, a, b, d in zip(counts, picks[:k], picks[k : 2 * k], picks[2 * k :], strict=True)
    ]


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
