"""The ladder index: the upstream's resident LRU and record ladder (spec §2, §4, §5), plus the
accounting both indexes report.

A restore probes the lookup grid longest first; a record stores the record ladder's lengths, each
as its own entry of a :class:`~stage_runtime.cache.resident.ResidentActivationCache`. The store's
clock and counters advance exactly as if every grid length were hashed and looked up, but only
lengths that can hit are hashed: those whose grid fingerprint
(:class:`~stage_runtime.cache.prompt.GridFingerprints`) is the fingerprint of a resident entry
recorded here. The fingerprints of evicted entries are kept with their tombstones, so a miss
looks up the tombstones of only the lengths that may have one, to say whether it is
``never_seen`` or ``evicted``. One count per fingerprint of each kind, side by side, so a restore
intersects the grid with one dict and an eviction moves a count from one side to the other.

Entries written into the store behind the index's back (the seed-parity API allows it) have no
fingerprint: from the first one on, the index probes and checks every grid length, as the spec
reads literally. Results are the same either way.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from typing import Final

from stage_runtime._unchecked import unchecked_constructor
from stage_runtime.accounting import CacheAccounting, MissReason, PrefixFootprint
from stage_runtime.cache.paged.chains import PageChain, page_chain
from stage_runtime.cache.prompt import GridFingerprints, Prompt
from stage_runtime.cache.resident import EvictedEntry, ResidentActivationCache, ResidentCacheStats
from stage_runtime.cache.results import (
    ActivationRestore,
    ResidentActivationRecord,
)
from stage_runtime.config import KvCacheConfig
from stage_runtime.frames import ActivationFrame
from stage_runtime.identity import TokenArray
from stage_runtime.policy import CandidatePolicy
from stage_runtime.tenancy import paged_namespace

__all__ = ["LadderIndex"]

TOMBSTONES: Final = 65536
"""Evicted keys remembered to tell ``evicted`` misses from ``never_seen`` ones."""

_Group = tuple[int, int, str | None, str | None]
_Print = tuple[_Group, int] | None
"""Where an entry's key lives (its prompt's group) and its grid fingerprint; None when the entry
was written behind the index's back."""

RESIDENT: Final = 0
BURIED: Final = 1
"""The two counts of a fingerprint (see ``LadderIndex._print_counts``)."""


class _PendingPrompt:
    """A recorded prompt whose page chain (for the footprint) is computed only when asked."""

    __slots__ = ("_chain", "namespace", "page_tokens", "tokens")

    def __init__(self, namespace: bytes, tokens: TokenArray, page_tokens: int) -> None:
        self.namespace = namespace
        self.tokens = tokens
        self.page_tokens = page_tokens
        self._chain: PageChain | None = None

    def chain(self) -> PageChain:
        if self._chain is None:
            self._chain = page_chain(self.namespace, self.tokens, page_tokens=self.page_tokens)
        return self._chain


class LadderIndex:
    """The ladder index of one stage cache. Single owner, synchronous.

    Args:
        cache_config: The cache settings (bounds, minimum length, footprint page size).
        policy: The lookup grid and record ladder.
        store: The store to keep the entries in; one built from ``cache_config`` when None.
    """

    kind = "ladder"

    def __init__(
        self,
        cache_config: KvCacheConfig,
        policy: CandidatePolicy,
        *,
        store: ResidentActivationCache | None = None,
    ) -> None:
        self.policy = policy
        if store is None:
            store = ResidentActivationCache(
                max_entries=cache_config.max_entries,
                max_bytes=cache_config.max_bytes,
                min_tokens=cache_config.min_tokens,
            )
        self.store = store
        """The entries (the upstream's resident cache)."""
        self.probe_all = False
        """Hash and look up every grid length on restore, as the spec reads literally (same
        results, clock and counters; only slower)."""
        self.last_miss_reason: MissReason | None = None
        self._page_tokens = cache_config.effective_page_tokens
        self._prints: dict[str, _Print] = {}
        """Fingerprint of each resident entry recorded here."""
        self._print_counts: dict[_Group, dict[int, list[int]]] = {}
        """Per group and fingerprint, how many resident entries recorded here have it, and how
        many tombstones (``[resident, buried]``; dropped when both are 0)."""
        self._records = 0
        """Entries this index stored: the store's count differs once someone else stores."""
        self._foreign = False
        """Whether the store has ever held an entry recorded behind the index's back."""
        self._tombstones: OrderedDict[str, _Print] = OrderedDict()
        self._lookups = 0
        self._hits = 0
        self._restored_tokens = 0
        self._misses: dict[MissReason, int] = {"never_seen": 0, "evicted": 0, "rejected": 0}
        self._footprint = PrefixFootprint()
        self._pending: dict[str, tuple[_PendingPrompt, int, int]] = {}
        """Resident entries not yet added to the footprint: (prompt, token count, bytes per
        token). Cutting a prompt into pages for the footprint costs another pass over its
        tokens, needed only when :meth:`accounting` is read and only for entries resident then."""
        self._namespace_bpt: dict[bytes, int] = {}
        """Bytes per token first recorded under each footprint namespace."""
        self._eager_footprint = False
        """Set once a namespace sees a second bytes-per-token: the footprint's per-group width
        then depends on the order of adds and removes, so entries are added as recorded."""
        self._namespaces: dict[tuple[int, _Group], bytes] = {}
        self._key_maker: _KeyMaker | None = None

    def lookup_candidates(self, token_count: int) -> int:
        """Lookups a restore of ``token_count`` tokens counts: every length of the grid."""
        return self.policy.candidate_count(token_count)

    # ------------------------------------------------------------------------------ restore

    def restore(self, prompt: Prompt) -> ActivationRestore | None:
        """The longest cached, validated prefix of the prompt, or None (spec §5.1).

        Grid lengths are probed longest first. A hit is used only if its recorded token count,
        its frame's token count, its frame's payload size and its recorded byte size agree with
        the length; otherwise the next shorter length is tried (the failed hit still counts as
        a use of that entry). The prompt must have tokens.
        """
        store = self.store
        policy = self.policy
        if (
            self._foreign
            or self.probe_all
            or store._records != self._records
            or len(store._entries) != len(self._prints)
        ):
            return self._restore_probing(prompt, prompt.grid(policy))
        if prompt.n < policy.min_tokens:
            # The grid is the prompt's length alone, and nothing this short was ever stored or
            # buried here (a record stores min_tokens or more): a miss, with no grid to make.
            self._missed_unprobed(prompt, 1, [])
            return None
        grid = prompt.grid(policy)
        if grid.shared_prints:
            return self._restore_probing(prompt, grid)
        # The usual case, as _restore_probing would do it (a third of a stage's cache work).
        by_print = grid.by_print
        known = self._print_counts.get(prompt.group)
        matched = by_print.keys() & known.keys() if known is not None else None
        if not matched:
            self._missed_unprobed(prompt, len(grid.counts), [])
            return None
        assert known is not None
        probes: list[int] = []
        suspects: list[int] = []
        for f in matched:
            resident, buried = known[f]
            if resident:
                probes.append(by_print[f])
            if buried:
                suspects.append(by_print[f])
        if probes:
            probes.sort(reverse=True)
            return self._probe(prompt, grid, probes, suspects)
        self._missed_unprobed(prompt, len(grid.counts), suspects)
        return None

    def _restore_probing(self, prompt: Prompt, grid: GridFingerprints) -> ActivationRestore | None:
        """:meth:`restore` in every case (entries written behind the index's back, probing
        every length, lengths sharing a fingerprint)."""
        store = self.store
        counts = grid.counts
        total = len(counts)
        # Entries written behind the index's back have no fingerprint: from the first one on,
        # every grid length is hashed and checked.
        slow = self._foreign or (
            store._records != self._records or len(store._entries) != len(self._prints)
        )
        if slow:
            self._foreign = True
        known = self._print_counts.get(prompt.group)
        if slow or self.probe_all:
            probes = counts
        else:
            probes = _among(grid, known, RESIDENT) if known else []
        if slow:
            suspects = counts if self._tombstones else []
        else:
            suspects = _among(grid, known, BURIED) if known else []
        if not probes:
            self._missed_unprobed(prompt, total, suspects)
            return None
        return self._probe(prompt, grid, probes, suspects)

    def _missed_unprobed(self, prompt: Prompt, total: int, suspects: list[int]) -> None:
        """Every one of the ``total`` grid lengths misses without a lookup: account for them as
        lookups would; the miss is ``evicted`` when one of ``suspects`` has a tombstone."""
        store = self.store
        store._clock += total  # (store._miss, inline)
        store._lookups += total
        reason: MissReason = "never_seen"
        if suspects:
            # The record of this prompt comes next: its lengths join the same pass.
            hashes = prompt.hash_counts([*suspects, *prompt.record_counts(self.policy)])
            key_of = self._keys(prompt)
            tombstones = self._tombstones
            if any(key_of(count, hashes[count]) in tombstones for count in suspects):
                reason = "evicted"
        self._missed(reason)

    def _probe(
        self, prompt: Prompt, grid: GridFingerprints, probes: list[int], suspects: list[int]
    ) -> ActivationRestore | None:
        """Look up ``probes`` (grid lengths, longest first) until one hits and validates; the
        lengths between them miss without a lookup. ``suspects``: the lengths that may have a
        tombstone, to tell an ``evicted`` miss from a ``never_seen`` one."""
        store = self.store
        total = len(grid.counts)
        hits_before = store.hits
        # The record of this prompt comes next: its lengths join the same pass.
        wanted = [*probes, *suspects, *prompt.record_counts(self.policy)]
        hashes = prompt.hash_counts(wanted)
        position = 0  # grid index of the next length not yet accounted for
        key_of = self._keys(prompt)
        for count in probes:
            index = grid.position(count)
            if index > position:
                store._miss(index - position)
            position = index + 1
            key = key_of(count, hashes[count])
            hit = store.lookup(key)
            if hit is None:
                continue
            frame = hit.frame
            if (
                hit.token_count == count
                and frame.desc.token_count == count
                and frame.desc.payload_bytes == hit.byte_size
                and frame.payload.size == hit.byte_size
            ):
                self._lookups += 1
                self._hits += 1
                self._restored_tokens += count
                self.last_miss_reason = None
                return ActivationRestore(
                    identity_of=(
                        prompt.config,
                        prompt.base,
                        prompt.token_start,
                        prompt.tokens,
                        count,
                        hashes[count],
                    ),
                    page_id=key,
                    token_count=count,
                    payload_bytes=hit.byte_size,
                    entries=hit.entries,
                    desc=frame.desc,
                    whole=frame,
                )
        if total > position:
            store._miss(total - position)
        if store.hits > hits_before:
            self._missed("rejected")
            return None
        tombstones = self._tombstones
        if any(key_of(c, hashes[c]) in tombstones for c in suspects):
            self._missed("evicted")
            return None
        self._missed("never_seen")
        return None

    def _missed(self, reason: MissReason) -> None:
        self._lookups += 1
        self._misses[reason] += 1
        self.last_miss_reason = reason

    def _keys(self, prompt: Prompt) -> _KeyMaker:
        """The key maker of ``prompt``'s stage, start and width (the last one, usually)."""
        maker = self._key_maker
        if (
            maker is None
            or maker.config is not prompt.config
            or maker.token_start != prompt.token_start
            or maker.width != prompt.width
        ):
            maker = self._key_maker = _KeyMaker(prompt)
        return maker

    # ------------------------------------------------------------------------------- record

    def record(self, prompt: Prompt, frame: ActivationFrame) -> list[ResidentActivationRecord]:
        """Store ``frame`` under each length of the record ladder (spec §5.2).

        Nothing is stored for fewer than ``min_tokens`` tokens, an empty payload, or a frame
        whose counts disagree with the prompt or its payload. Each length stores a zero-copy
        prefix view of ``frame`` (cut when first looked up); when the frame cannot be cut
        (opaque layout, side-band flags, ragged rows), only its full length is stored.

        Returns:
            One record per stored length, longest first, with the evictions it caused.
        """
        n = prompt.n
        payload_bytes = frame.payload.size
        policy = self.policy
        if n < policy.min_tokens or payload_bytes == 0:
            return []
        desc = frame.desc
        if desc.token_count != n or desc.payload_bytes != payload_bytes:
            return []
        counts = prompt.record_counts(policy)
        if not counts:
            return []
        hashes = prompt.hash_counts(counts)
        store = self.store
        entries = store._entries
        maker = self._keys(prompt)
        head, middle, tail = maker.head, maker.middle, maker.tail
        grid = prompt.grid(policy)
        prints = grid.prints
        group = prompt.group
        fingerprints = self._prints
        tombstones = self._tombstones
        print_counts = self._print_counts
        queued = self._pending
        # Every length below n cuts the frame the same way (its layout, flags and rows), so
        # one check answers for all of them; each entry is cut when first looked up.
        cuttable = len(counts) == 1 or frame.prefix_error(counts[-1]) is None
        row_bytes = payload_bytes // n
        # Bytes per token of every length stored: a cut one holds row_bytes per token (a cut
        # of 0 bytes is refused), the whole one payload_bytes // n, at least 1.
        bpt = row_bytes if row_bytes else 1
        pending: _PendingPrompt | None = None
        records: list[ResidentActivationRecord] = []
        for count in counts:
            if count == n:
                size, cut = payload_bytes, None
            elif cuttable:
                size, cut = row_bytes * count, count
            else:
                continue
            key = f"{head}{count}{middle}{hashes[count][7:23]}{tail}"  # (the key maker's call)
            evicted = store._store(key, count, size, frame, cut)
            if evicted is None:  # refused
                records.append(
                    _resident_record(
                        key, count, size, 0, 0, len(entries), store._resident_bytes, ()
                    )
                )
                continue
            self._records += 1
            # The bookkeeping: what left, then the entry that came in.
            if not evicted:
                gone = 0
            elif len(evicted) == 1:  # the usual eviction: one entry, by a bound
                victim = evicted[0]
                gone = victim.payload_bytes
                self._bury(victim.key)
            else:
                self._evicted(evicted)
                gone = sum(entry.payload_bytes for entry in evicted)
            records.append(
                _resident_record(
                    key,
                    count,
                    size,
                    len(evicted),
                    gone,
                    len(entries),
                    store._resident_bytes,
                    evicted,
                )
            )
            if key not in fingerprints:
                # (grid.position(count): n is first, the other lengths are grid lines)
                fingerprint = prints[0 if count == n else grid.position(count)]
                fingerprints[key] = (group, fingerprint)
                known = print_counts.get(group)
                if known is None:
                    print_counts[group] = {fingerprint: [1, 0]}
                else:
                    pair = known.get(fingerprint)
                    if pair is None:
                        known[fingerprint] = [1, 0]
                    else:
                        pair[RESIDENT] += 1
            if key in tombstones:
                self._unbury(key)
            if pending is None:
                pending = _PendingPrompt(self._namespace(prompt), prompt.tokens, self._page_tokens)
                if (
                    not self._eager_footprint
                    and self._namespace_bpt.setdefault(pending.namespace, bpt) != bpt
                ):
                    self._flush_footprint()
                    self._eager_footprint = True
            if self._eager_footprint:
                self._footprint.add(key, pending.chain().segments(count), bpt)
            elif key not in queued:
                queued[key] = (pending, count, bpt)
        return records

    def _namespace(self, prompt: Prompt) -> bytes:
        memo_key = (id(prompt.config), prompt.group)
        namespace = self._namespaces.get(memo_key)
        if namespace is None:
            if len(self._namespaces) >= 64:
                self._namespaces.clear()
            namespace = paged_namespace(
                prompt.config, prompt.token_start, prompt.base, prompt.width
            )
            self._namespaces[memo_key] = namespace
        return namespace

    def _evicted(self, entries: Sequence[EvictedEntry]) -> None:
        """Entries left the store: forget their footprint and fingerprint, and bury the ones
        the bounds evicted (``cleared`` ones leave no tombstone)."""
        for entry in entries:
            key = entry.key
            if entry.reason != "cleared":
                self._bury(key)
                continue
            if self._pending.pop(key, None) is None:
                self._footprint.remove(key)
            where = self._prints.pop(key, None)
            if where is not None:
                _uncount(self._print_counts, where, RESIDENT)

    def _bury(self, key: str) -> None:
        """The bounds evicted ``key``: forget its footprint and fingerprint, and keep its
        tombstone (its fingerprint's count moves from resident to buried)."""
        if self._pending.pop(key, None) is None:
            self._footprint.remove(key)
        where = self._prints.pop(key, None)
        tombstones = self._tombstones
        if key in tombstones:
            self._unbury(key)
        tombstones[key] = where
        if where is not None:
            # Resident to buried: the count pair stays (its resident count was > 0).
            both = self._print_counts[where[0]][where[1]]
            both[RESIDENT] -= 1
            both[BURIED] += 1
        if len(tombstones) > TOMBSTONES:
            self._forget_oldest()

    def _forget_oldest(self) -> None:
        """Drop the oldest tombstones beyond :data:`TOMBSTONES`."""
        tombstones = self._tombstones
        while len(tombstones) > TOMBSTONES:
            _, oldest = tombstones.popitem(last=False)
            if oldest is not None:
                _uncount(self._print_counts, oldest, BURIED)

    def _unbury(self, key: str) -> None:
        """``key`` is resident again: forget its tombstone."""
        if key in self._tombstones:
            where = self._tombstones.pop(key)
            if where is not None:
                _uncount(self._print_counts, where, BURIED)

    # -------------------------------------------------------------------------- housekeeping

    def clear(self) -> tuple[EvictedEntry, ...]:
        """Drop every entry; returns them with reason ``"cleared"``."""
        cleared = self.store.clear()
        self._evicted(cleared)
        return cleared

    def statistics(self) -> ResidentCacheStats:
        """The store's counters (``lookups``, ``hits`` and ``misses`` count grid probes)."""
        return self.store.stats()

    def accounting(self) -> CacheAccounting:
        """Hits, misses by reason, restored tokens and resident vs unique-prefix bytes."""
        self._flush_footprint()
        stats = self.store.stats()
        return CacheAccounting(
            index="ladder",
            lookups=self._lookups,
            hits=self._hits,
            misses_never_seen=self._misses["never_seen"],
            misses_evicted=self._misses["evicted"],
            misses_rejected=self._misses["rejected"],
            restored_tokens=self._restored_tokens,
            entries=stats.entries,
            resident_bytes=stats.resident_bytes,
            unique_prefix_bytes=self._footprint.unique_bytes(),
            evictions=stats.evictions,
            evicted_bytes=stats.evicted_bytes,
        )

    def _flush_footprint(self) -> None:
        """Add the queued resident entries to the footprint, in the order they were recorded."""
        footprint = self._footprint
        store = self.store
        for key, (prompt, count, bpt) in self._pending.items():
            if key in store:  # (an entry dropped behind the index's back is not)
                footprint.add(key, prompt.chain().segments(count), bpt)
        self._pending.clear()


_resident_record = unchecked_constructor(ResidentActivationRecord)
"""``ResidentActivationRecord`` from every field in order, unchecked."""


class _KeyMaker:
    """Builds the ``act:`` keys of one prompt's lengths (spec §1.3)."""

    __slots__ = ("config", "head", "middle", "tail", "token_start", "width")

    def __init__(self, prompt: Prompt) -> None:
        self.config = config = prompt.config
        self.token_start = prompt.token_start
        self.width = prompt.width
        self.head = f"act:{config.stage_id}:{prompt.token_start}:"
        self.middle = f":{config.layer_start}:"
        self.tail = f":w{max(prompt.width, 0)}"

    def __call__(self, count: int, prefix_hash: str) -> str:
        # page_id() then activation_page_id(), for a "blake3:" hash.
        return f"{self.head}{count}{self.middle}{prefix_hash[7:23]}{self.tail}"


def _uncount(
    counts: dict[_Group, dict[int, list[int]]], where: tuple[_Group, int], side: int
) -> None:
    """One count less on ``side`` (:data:`RESIDENT` or :data:`BURIED`) of the fingerprint
    ``where`` names; the pair goes when both are 0, the group when it has none left."""
    group, fingerprint = where
    known = counts[group]
    both = known[fingerprint]
    both[side] -= 1
    if not (both[RESIDENT] or both[BURIED]):
        del known[fingerprint]
        if not known:
            del counts[group]


def _among(grid: GridFingerprints, known: dict[int, list[int]], side: int) -> list[int]:
    """The candidate lengths of ``grid`` whose fingerprint has a count on ``side`` of
    ``known``, longest first (:meth:`GridFingerprints.among` of those fingerprints; only the
    probing path, which is not the usual one, asks)."""
    return grid.among({f: pair for f, pair in known.items() if pair[side]})
