"""The seed-parity API of a stage's activation cache (spec §3, §5, §6), synchronous.

:class:`KvStageIntegration` keeps the upstream's names and signatures (every call names the
stage's configuration) over a :class:`~stage_runtime.cache.stage_cache.StageCache`, which does
the work with one index: :class:`LadderStageIntegration` over the ladder index (the upstream's
behaviour), :class:`PagedStageIntegration` over the paged one. A stage asks it to restore the
longest cached prefix of a prompt, computes the rest, then asks it to record the full output
frame.

Every argument is validated before the cache is touched, so a rejected call (a
:class:`~stage_runtime.errors.ConfigError` or :class:`~stage_runtime.errors.FrameError`) leaves the
cache exactly as it was: same entries, same recency, same counters. A restore and the record of
the same tokens hash them once.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np
import numpy.typing as npt

from stage_runtime.accounting import CacheAccounting, MissReason
from stage_runtime.cache.ladder import LadderIndex
from stage_runtime.cache.paged.index import PagedActivationIndex
from stage_runtime.cache.paged.stage_index import PagedIndex
from stage_runtime.cache.prompt import Prompt
from stage_runtime.cache.resident import EvictedEntry, ResidentActivationCache, ResidentCacheStats
from stage_runtime.cache.results import (
    ActivationRecordSummary,
    ActivationRestore,
    PageIdentity,
    PrefillKvIdentity,
    ResidentActivationRecord,
    ResidentActivationRestore,
    prefill_kv_identity,
    summarize_records,
)
from stage_runtime.cache.stage_cache import StageCache, effective_cache_payload
from stage_runtime.config import (
    CacheMode,
    CachePayload,
    KvCacheConfig,
    MessageBase,
    StageConfig,
)
from stage_runtime.errors import ConfigError
from stage_runtime.frames import ActivationFrame
from stage_runtime.policy import CandidatePolicy

__all__ = [
    "ActivationRecordSummary",
    "KvStageIntegration",
    "LadderStageIntegration",
    "PageIdentity",
    "PagedActivationRestore",
    "PagedStageIntegration",
    "PrefillKvIdentity",
    "ResidentActivationRecord",
    "ResidentActivationRestore",
    "effective_cache_payload",
    "summarize_records",
]

PagedActivationRestore = ActivationRestore
"""The streaming form of a hit (the reply of both indexes); the name the paged index gave it."""


class KvStageIntegration:
    """A stage's activation cache with the upstream's restore and record rules.

    Build it with :meth:`from_config` (or around a :class:`StageCache` of your own). Single
    owner: a cache actor holds it and is the only caller.
    """

    __slots__ = ("probe_all", "stage_cache")

    def __init__(self, stage_cache: StageCache) -> None:
        self.stage_cache = stage_cache
        """The cache this API drives."""
        self.probe_all = False
        """Hash and look up every candidate on restore, as the spec reads literally (the ladder
        index; same results, clock and counters)."""

    @classmethod
    def from_config(
        cls, config: StageConfig, *, environ: Mapping[str, str] | None = None
    ) -> KvStageIntegration | None:
        """The integration of a stage, or None when its cache is disabled (spec §6): a
        :class:`LadderStageIntegration` or a :class:`PagedStageIntegration`, as
        ``kv_cache.index`` says. See :meth:`StageCache.from_config`.

        Raises:
            ConfigError: ``config`` is not a StageConfig, or an environment variable is invalid.
        """
        stage_cache = StageCache.from_config(config, environ=environ)
        if stage_cache is None:
            return None
        if isinstance(stage_cache.index, PagedIndex):
            return PagedStageIntegration(stage_cache)
        return LadderStageIntegration(stage_cache)

    @classmethod
    def around(
        cls,
        config: StageConfig,
        cache_config: KvCacheConfig,
        policy: CandidatePolicy,
        cache: ResidentActivationCache,
    ) -> KvStageIntegration:
        """A ladder integration keeping its entries in ``cache`` (a store built by hand)."""
        index = LadderIndex(cache_config, policy, store=cache)
        return LadderStageIntegration(StageCache(config, cache_config, policy, index))

    # ---------------------------------------------------------------------------------- modes

    @property
    def mode(self) -> CacheMode:
        """``record`` or ``lookup-record``."""
        return self.stage_cache.mode

    @property
    def payload(self) -> CachePayload:
        """The resolved payload kind (informational for activations)."""
        return self.stage_cache.payload

    @property
    def cache_config(self) -> KvCacheConfig:
        """The settings the cache was built from."""
        return self.stage_cache.cache_config

    @property
    def policy(self) -> CandidatePolicy:
        """Lookup grid and record ladder."""
        return self.stage_cache.policy

    @property
    def cache(self) -> ResidentActivationCache:
        """The ladder index's entries (the upstream's resident cache).

        Raises:
            AttributeError: the cache is paged (its pages are :attr:`PagedStageIntegration.index`).
        """
        index = self.stage_cache.index
        if not isinstance(index, LadderIndex):
            msg = "a paged cache has no ladder store: its pages are PagedStageIntegration.index"
            raise AttributeError(msg)
        return index.store

    @property
    def cache_healthy(self) -> bool:
        """Cleared to stop all lookups and records (the upstream's V-E health gate)."""
        return self.stage_cache.healthy

    @cache_healthy.setter
    def cache_healthy(self, healthy: bool) -> None:
        self.stage_cache.healthy = healthy

    @property
    def last_miss_reason(self) -> MissReason | None:
        """Why the latest restore that looked something up restored nothing (``never_seen``,
        ``evicted`` or ``rejected``); None after a hit."""
        return self.stage_cache.last_miss_reason

    def should_lookup(self) -> bool:
        """Whether restores look anything up (``lookup-record`` mode, healthy)."""
        return self.stage_cache.should_lookup()

    def should_record(self) -> bool:
        """Whether records store anything (``record`` or ``lookup-record`` mode, healthy)."""
        return self.stage_cache.should_record()

    def lookup_candidates(self, token_count: int) -> int:
        """How many lookups a restore of a ``token_count``-token prompt counts: every length of
        the lookup grid (spec §2.1) for the ladder, one walk of the page chain when paged."""
        return self.stage_cache.lookup_candidates(token_count)

    # ----------------------------------------------------------------------------- identities

    def prefill_identity(
        self,
        config: StageConfig,
        base: MessageBase,
        token_start: int,
        tokens: Sequence[int] | npt.NDArray[np.integer],
    ) -> PrefillKvIdentity:
        """The identity of the whole token run (spec §1.1).

        Raises:
            ConfigError: bad config, base, token_start or tokens.
        """
        prompt = self.stage_cache.prompt(config, base, token_start, tokens, 0)
        return self._identities(prompt.config, base, prompt, [prompt.n])[0]

    def activation_lookup_identities(
        self,
        config: StageConfig,
        base: MessageBase,
        token_start: int,
        tokens: Sequence[int] | npt.NDArray[np.integer],
    ) -> list[PrefillKvIdentity]:
        """Identities of every lookup candidate, longest first (spec §3), in one pass.

        Raises:
            ConfigError: bad config, base, token_start or tokens.
        """
        prompt = self.stage_cache.prompt(config, base, token_start, tokens, 0)
        counts = self.policy.candidate_token_counts(prompt.n)
        return self._identities(config, base, prompt, counts)

    def activation_record_identities(
        self,
        config: StageConfig,
        base: MessageBase,
        token_start: int,
        tokens: Sequence[int] | npt.NDArray[np.integer],
    ) -> list[PrefillKvIdentity]:
        """Identities of every record candidate, longest first (spec §3), in one pass.

        Raises:
            ConfigError: bad config, base, token_start or tokens.
        """
        prompt = self.stage_cache.prompt(config, base, token_start, tokens, 0)
        counts = self.policy.record_candidate_token_counts(prompt.n)
        return self._identities(config, base, prompt, counts)

    def _identities(
        self, config: StageConfig, base: MessageBase, prompt: Prompt, counts: list[int]
    ) -> list[PrefillKvIdentity]:
        hashes = prompt.hash_counts(counts)
        return [
            prefill_kv_identity(config, base, prompt.token_start, prompt.tokens, c, hashes[c])
            for c in counts
        ]

    # --------------------------------------------------------------------- restore and record

    def restore_resident_activation(
        self,
        config: StageConfig,
        base: MessageBase,
        token_start: int,
        tokens: Sequence[int] | npt.NDArray[np.integer],
        activation_width: int,
    ) -> ResidentActivationRestore | None:
        """The longest cached, validated prefix of ``tokens`` as one frame, or None (spec §5.1).

        Ladder: candidates are probed longest first; a hit is used only if its recorded token
        count, its frame's token count, its frame's payload size and its recorded byte size all
        agree with the candidate; otherwise the next shorter candidate is tried (the failed hit
        still counts as a use of that entry). Paged: the longest run of cached pages, joined.

        Args:
            config: The stage.
            base: The message envelope; ``chat_template_id`` is the cache namespace.
            token_start: Position of the first token.
            tokens: The prompt's token ids.
            activation_width: Width of the activation rows; part of the cache key.

        Raises:
            ConfigError: a bad argument; the cache is left unchanged.
        """
        found = self.restore_resident_pages(config, base, token_start, tokens, activation_width)
        return None if found is None else found.to_restore()

    def restore_resident_pages(
        self,
        config: StageConfig,
        base: MessageBase,
        token_start: int,
        tokens: Sequence[int] | npt.NDArray[np.integer],
        activation_width: int,
    ) -> ActivationRestore | None:
        """:meth:`restore_resident_activation`, page by page without copying (a ladder hit is
        one page: its cached frame).

        Raises:
            ConfigError: a bad argument; the cache is left unchanged.
        """
        cache = self.stage_cache
        prompt = cache.prompt(config, base, token_start, tokens, activation_width)
        index = cache.index
        if isinstance(index, LadderIndex):
            index.probe_all = self.probe_all
        return cache.restore_prompt(prompt)

    def record_resident_activation(
        self,
        config: StageConfig,
        base: MessageBase,
        token_start: int,
        tokens: Sequence[int] | npt.NDArray[np.integer],
        activation_width: int,
        frame: ActivationFrame,
    ) -> list[ResidentActivationRecord]:
        """Store ``frame`` under each record candidate of ``tokens`` (spec §5.2), or as pages.

        Nothing is stored when the mode does not record, there are no tokens, fewer than
        ``min_tokens``, an empty payload, or a frame whose token count is not ``len(tokens)``.
        Ladder: each candidate stores a zero-copy prefix view of ``frame``; a candidate the frame
        cannot be cut at (opaque layout, side-band flags, ragged rows) is skipped alone. Paged:
        one record for the call (tokens now covered, bytes newly stored).

        Args:
            config: The stage.
            base: The message envelope; ``chat_template_id`` is the cache namespace.
            token_start: Position of the first token.
            tokens: The prompt's token ids.
            activation_width: Width of the activation rows; part of the cache key.
            frame: This stage's output for all of ``tokens``.

        Returns:
            What was stored, longest first, with the evictions each store caused.

        Raises:
            ConfigError: a bad argument; the cache is left unchanged.
            FrameError: ``frame`` is not an ActivationFrame; the cache is left unchanged.
        """
        cache = self.stage_cache
        prompt = cache.prompt(config, base, token_start, tokens, activation_width)
        return cache.record_prompt(prompt, frame)

    def clear(self) -> tuple[EvictedEntry, ...]:
        """Drop every cached frame; returns them with reason ``"cleared"``."""
        return self.stage_cache.clear()

    def stats(self) -> ResidentCacheStats:
        """The cache's counters (the upstream's name; :meth:`StageCache.statistics`)."""
        return self.stage_cache.statistics()

    def accounting(self) -> CacheAccounting:
        """Hits, misses by reason, restored tokens and resident vs unique-prefix bytes."""
        return self.stage_cache.accounting()


class LadderStageIntegration(KvStageIntegration):
    """The upstream's ladder index (the default), plus the accounting both indexes report."""

    __slots__ = ()


class PagedStageIntegration(KvStageIntegration):
    """The paged index: prompts that share a prefix share its pages (see
    :mod:`stage_runtime.cache.paged`)."""

    __slots__ = ()

    @property
    def index(self) -> PagedActivationIndex:
        """The pages, bounded by the config's ``max_entries`` and ``max_bytes``."""
        index = self.stage_cache.index
        if not isinstance(index, PagedIndex):
            msg = "a PagedStageIntegration needs a paged index"
            raise ConfigError(msg)
        return index.index
