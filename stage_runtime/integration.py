"""Restore and record rules of a stage's activation cache (spec §3, §5, §6), synchronous.

:class:`KvStageIntegration` ties a stage's configuration to its candidate policy and its
:class:`~stage_runtime.cache.ResidentActivationCache`. A stage asks it to restore the longest
cached prefix of a prompt, computes the rest, then asks it to record the full output frame.

Every argument is validated before the cache is touched, so a rejected call (a
:class:`~stage_runtime.errors.ConfigError` or :class:`~stage_runtime.errors.FrameError`) leaves the
cache exactly as it was: same entries, same recency, same counters.

A stage calls restore and then record with the same tokens. The cache indexes its keys by
``(token_start, width, token_count)``, so a restore hashes only the candidate lengths that could
hit (the others are accounted as misses without hashing, exactly as probing them would be). It
hashes the record lengths in the same pass; the hashes are remembered (keyed on the token
*contents*, compared against a private copy) and reused by the record, so the pair costs about
one pass over the tokens.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Final

import attrs
import numpy as np
import numpy.typing as npt

from stage_runtime.accounting import CacheAccounting, MissReason
from stage_runtime.cache import (
    EvictedEntry,
    ResidentActivationCache,
    ResidentCacheStats,
)
from stage_runtime.config import (
    CacheIndex,
    CacheMode,
    CachePayload,
    KvCacheConfig,
    MessageBase,
    StageConfig,
    _environment,
    kill_switch_engaged,
)
from stage_runtime.errors import ConfigError, FrameError
from stage_runtime.frames import ActivationFrame
from stage_runtime.identity import (
    RUNTIME_ABI_VERSION,
    TokenArray,
    activation_page_id,
    as_token_array,
    page_id,
    prefix_hashes,
    prefix_namespace_hash,
)
from stage_runtime.policy import CandidatePolicy, derive_max_resident_tokens
from stage_runtime.tenancy import salted_prefix_hashes

__all__ = [
    "ActivationRecordSummary",
    "activation_key_slot",
    "KvStageIntegration",
    "PageIdentity",
    "PrefillKvIdentity",
    "ResidentActivationRecord",
    "ResidentActivationRestore",
    "effective_cache_payload",
    "summarize_records",
]

_I32_MAX: Final = 2**31 - 1
_U64_MAX: Final = 2**64 - 1

# Substrings of model ids whose architectures keep recurrent state (spec §6 fallback table).
_RECURRENT_MARKERS: Final = (
    "falcon-h1",
    "qwen3next",
    "qwen3-next",
    "kimi-linear",
    "qwen35",
    "qwen3.5",
    "qwen3.8",
    "mamba",
    "rwkv",
    "jamba",
)


def effective_cache_payload(payload: CachePayload, model_id: str) -> CachePayload:
    """Resolve ``auto`` to the payload kind the model needs (spec §6).

    An explicit payload is kept. ``auto`` becomes ``kv-recurrent`` for model ids naming a
    recurrent or hybrid family, else ``resident-kv``. Unlike the upstream, an unrecognised model
    does not disable the cache: activations are cached the same way whatever the payload.
    """
    if payload is not CachePayload.AUTO:
        return payload
    lowered = model_id.lower()
    if any(marker in lowered for marker in _RECURRENT_MARKERS):
        return CachePayload.KV_RECURRENT
    return CachePayload.RESIDENT_KV


@attrs.frozen(kw_only=True)
class PageIdentity:
    """Metadata describing a cached page (spec §1.1); only ``prefix_hash`` is a hash."""

    model_id: str
    model_revision: str = "unknown"
    runtime_abi_version: str = RUNTIME_ABI_VERSION
    topology_id: str
    stage_id: str
    stage_index: int
    layer_start: int
    layer_end: int
    prefix_hash: str
    """``"blake3:"`` + 64 hex digits over the identity stream and the prefix tokens."""
    session_id: str
    """The requesting session: metadata only, never hashed (prefixes are shared)."""
    token_start: int
    token_count: int
    """Length of the prefix."""
    generation: int = 1
    layout: str = "layer-contiguous"
    codec: str = "fp16"
    tokenizer_id: str
    """``MessageBase.tokenizer_id``, or the model id when absent."""
    chat_template_id: str
    """``MessageBase.chat_template_id`` or ``""``."""
    position_config_hash: str
    """``"ctx:{ctx_size}"``."""
    kv_dtype: str = "ggml-native-kv"


@attrs.frozen(kw_only=True, eq=False)
class PrefillKvIdentity:
    """The identity of one prefix of a prompt on one stage."""

    identity: PageIdentity
    """Descriptive metadata, including the prefix hash and token count."""

    page_id: str
    """``"{stage}:{start}:{count}:{layer_start}:{digest16}"``."""

    namespace: str
    """:func:`~stage_runtime.identity.prefix_namespace_hash` of the stage and cache namespace."""

    token_ids: TokenArray
    """The prefix's tokens: a read-only view, not a copy."""


@attrs.frozen(kw_only=True, eq=False)
class ResidentActivationRestore:
    """A validated hit: the longest cached prefix of the prompt."""

    identity: PrefillKvIdentity
    """Identity of the restored prefix."""

    page_id: str
    """The cache key that hit (``"act:...:w{width}"``)."""

    token_count: int
    """Tokens restored."""

    payload_bytes: int
    """Bytes of the restored frame."""

    entries: int
    """Entries resident at lookup time."""

    frame: ActivationFrame
    """The restored frame (shared with the cache, read-only)."""


@attrs.frozen(kw_only=True)
class ResidentActivationRecord:
    """One prefix length stored by a record call."""

    page_id: str
    """The cache key (``"act:...:w{width}"``)."""

    token_count: int
    """Tokens of this prefix."""

    payload_bytes: int
    """Bytes of this prefix's frame."""

    evicted_entries: int
    """Entries this store evicted."""

    evicted_bytes: int
    """Bytes this store evicted."""

    entries: int
    """Entries resident after this store."""

    resident_bytes: int
    """Bytes resident after this store."""

    evicted: Sequence[EvictedEntry] = ()
    """The entries this store evicted, least recently used first (a tuple from the ladder; from the
    paged index, an ``EvictedPages`` that builds each record when read, which ``attrs.asdict``
    leaves as it is: ``tuple(record.evicted)`` gives a plain tuple)."""


@attrs.frozen(kw_only=True)
class ActivationRecordSummary:
    """Totals over the records of one record call (the upstream's reply statistics)."""

    recorded_frames: int
    recorded_bytes: int
    evicted_entries: int
    evicted_bytes: int


def summarize_records(records: Iterable[ResidentActivationRecord]) -> ActivationRecordSummary:
    """Sum frames, bytes and evictions over records (binary transport statistics, spec §9.3)."""
    frames = recorded = entries = evicted = 0
    for record in records:
        frames += 1
        recorded += record.payload_bytes
        entries += record.evicted_entries
        evicted += record.evicted_bytes
    return ActivationRecordSummary(
        recorded_frames=frames,
        recorded_bytes=recorded,
        evicted_entries=entries,
        evicted_bytes=evicted,
    )


@attrs.define(eq=False)
class _HashMemo:
    """The prefix hashes of the last prompt seen, keyed on its contents."""

    config: StageConfig
    token_start: int
    namespace: str | None
    tokens: TokenArray
    """A private copy: the caller may reuse or mutate its own array."""
    hashes: dict[int, str]

    def matches(
        self, config: StageConfig, token_start: int, namespace: str | None, tokens: TokenArray
    ) -> bool:
        return (
            self.token_start == token_start
            and self.namespace == namespace
            and self.tokens.size == tokens.size
            and (self.config is config or self.config == config)
            and bool(np.array_equal(self.tokens, tokens))
        )


def _readonly(array: TokenArray) -> TokenArray:
    view = array.view()
    view.flags.writeable = False
    return view


@attrs.define(eq=False)
class KvStageIntegration:
    """A stage's activation cache with the upstream's restore and record rules.

    Build it with :meth:`from_config`. Single owner: a cache actor holds it and is the only
    caller.
    """

    mode: CacheMode
    """``record`` or ``lookup-record``."""

    payload: CachePayload
    """The resolved payload kind (informational for activations)."""

    cache_config: KvCacheConfig
    """The settings the cache was built from."""

    policy: CandidatePolicy
    """Lookup grid and record ladder."""

    cache: ResidentActivationCache
    """The cache itself."""

    cache_healthy: bool = True
    """Cleared to stop all lookups and records (the upstream's V-E health gate)."""

    probe_all: bool = False
    """Hash and look up every candidate on restore, as the spec reads literally. By default only
    candidate lengths with a resident key are hashed (same results, clock and counters); set this
    when something must see the key of every candidate (e.g. miss-reason tracking)."""

    last_miss_reason: MissReason | None = attrs.field(default=None, init=False)
    """Why the latest restore that looked something up restored nothing (``never_seen``,
    ``evicted`` or ``rejected``); None after a hit. Set by both index modes (the cache actor
    logs it on ``activation_missed``)."""

    _memo: _HashMemo | None = attrs.field(default=None, init=False, repr=False)

    @classmethod
    def from_config(
        cls, config: StageConfig, *, environ: Mapping[str, str] | None = None
    ) -> KvStageIntegration | None:
        """The integration of a stage, or None when its cache is disabled (spec §6).

        Cache settings come from ``config.kv_cache``, or from the environment when that is None
        (:meth:`KvCacheConfig.from_env`). None is returned when there are no settings, the mode is
        ``disabled`` or ``auto``, or the kill switch is engaged (``STAGE_RUNTIME_KV_CACHE`` or
        ``STAGE_RUNTIME_PREFIX_CACHE`` set to ``off`` and friends), even with a ``kv_cache`` block.
        The record ladder's token budget is derived from ``config.ctx_size`` (spec §6.2).

        Args:
            config: The stage.
            environ: Environment to read; ``os.environ`` when None.

        Raises:
            ConfigError: ``config`` is not a StageConfig, or an environment variable is invalid.
        """
        if not isinstance(config, StageConfig):
            msg = f"config must be a StageConfig, got {type(config).__name__}"
            raise ConfigError(msg)
        env = _environment(environ)
        if kill_switch_engaged(env):
            return None
        cache_config = (
            config.kv_cache if config.kv_cache is not None else KvCacheConfig.from_env(env)
        )
        if cache_config is None or cache_config.mode in (CacheMode.DISABLED, CacheMode.AUTO):
            return None
        policy = attrs.evolve(
            CandidatePolicy.from_cache_config(cache_config),
            max_resident_tokens_hint=derive_max_resident_tokens(config.ctx_size),
        )
        integration_cls = cls
        if cls is KvStageIntegration:
            # The index modes (issue 6) subclass this class, hence the late import.
            from stage_runtime.index_modes import LadderStageIntegration, PagedStageIntegration

            paged = cache_config.index is CacheIndex.PAGED
            integration_cls = PagedStageIntegration if paged else LadderStageIntegration
        return integration_cls(
            mode=cache_config.mode,
            payload=effective_cache_payload(cache_config.payload, config.model_id),
            cache_config=cache_config,
            policy=policy,
            cache=ResidentActivationCache(
                max_entries=cache_config.max_entries,
                max_bytes=cache_config.max_bytes,
                min_tokens=cache_config.min_tokens,
                key_index=activation_key_slot,
            ),
        )

    # ----------------------------------------------------------------------------------------
    # modes

    def should_lookup(self) -> bool:
        """Whether restores look anything up (``lookup-record`` mode, healthy)."""
        return self.cache_healthy and self.mode is CacheMode.LOOKUP_RECORD

    def should_record(self) -> bool:
        """Whether records store anything (``record`` or ``lookup-record`` mode, healthy)."""
        return self.cache_healthy and self.mode in (CacheMode.RECORD, CacheMode.LOOKUP_RECORD)

    def lookup_candidates(self, token_count: int) -> int:
        """How many lookups a restore of a ``token_count``-token prompt counts: every length of
        the lookup grid (spec §2.1), probed or accounted as a miss without hashing."""
        return self.policy.candidate_count(token_count)

    # ----------------------------------------------------------------------------------------
    # identities

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
        array = self._check(config, base, token_start, tokens)
        count = int(array.size)
        hashes = self._hashes(config, base, token_start, array, [count])
        return self._identity(config, base, token_start, array, count, hashes[count])

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
        array = self._check(config, base, token_start, tokens)
        counts = self.policy.candidate_token_counts(int(array.size))
        hashes = self._hashes(config, base, token_start, array, counts)
        return [self._identity(config, base, token_start, array, c, hashes[c]) for c in counts]

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
        array = self._check(config, base, token_start, tokens)
        counts = self.policy.record_candidate_token_counts(int(array.size))
        hashes = self._hashes(config, base, token_start, array, counts)
        return [self._identity(config, base, token_start, array, c, hashes[c]) for c in counts]

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
        """The longest cached, validated prefix of ``tokens``, or None (spec §5.1).

        Candidates are probed longest first. A hit is used only if its recorded token count,
        its frame's token count, its frame's payload size and its recorded byte size all agree
        with the candidate; otherwise the next shorter candidate is tried (the failed hit still
        counts as a use of that entry).

        Args:
            config: The stage.
            base: The message envelope; ``chat_template_id`` is the cache namespace.
            token_start: Position of the first token.
            tokens: The prompt's token ids.
            activation_width: Width of the activation rows; part of the cache key.

        Raises:
            ConfigError: a bad argument; the cache is left unchanged.
        """
        array = self._check(config, base, token_start, tokens)
        width = _check_width(activation_width)
        if not self.should_lookup() or array.size == 0:
            return None
        n = int(array.size)
        policy = self.policy
        total = policy.candidate_count(n)
        # Only candidates with a resident key of their (start, width, count) can hit; the others
        # are accounted as the misses they would be without hashing them (same clock, same
        # counters, same recency as probing every candidate).
        if not self.probe_all and self.cache.key_index is activation_key_slot:
            resident = self.cache.indexed_counts((str(token_start), f"w{width}"))
            if len(resident) < total:
                is_candidate = policy.is_candidate
                probes = sorted((c for c in resident if is_candidate(n, c)), reverse=True)
            else:  # the grid is descending: keep its order
                probes = [c for c in policy.candidate_token_counts(n) if c in resident]
            probes = self._filter_probes(base, token_start, width, array, probes)
        else:  # a cache built without our index: probe every candidate
            probes = policy.candidate_token_counts(n)
        if not probes:
            self.cache.count_misses(total)
            return None
        wanted = list(probes)
        if self.should_record():
            # The record of this prompt comes next: hash its lengths in the same pass.
            wanted += self.policy.record_candidate_token_counts(n)
        hashes = self._hashes(
            config,
            base,
            token_start,
            array,
            wanted,
            more=lambda: self._restore_extra_counts(
                base, token_start, width, array, policy.candidate_token_counts(n)
            ),
        )
        # Walk the probes longest first; every candidate between two probes is a miss, counted
        # by its position in the grid rather than by listing the grid.
        position = 0  # grid index of the next candidate not yet accounted for
        for count in probes:
            index = policy.candidate_index(n, count)
            if index > position:
                self.cache.count_misses(index - position)
            position = index + 1
            pid = page_id(config, token_start, count, hashes[count])
            key = activation_page_id(pid, width)
            hit = self.cache.lookup(key)
            if hit is not None:
                frame = hit.frame
                if (
                    hit.token_count == count
                    and frame.desc.token_count == count
                    and frame.desc.payload_bytes == hit.byte_size
                    and frame.payload.size == hit.byte_size
                ):
                    identity = self._identity(
                        config, base, token_start, array, count, hashes[count]
                    )
                    return ResidentActivationRestore(
                        identity=identity,
                        page_id=key,
                        token_count=count,
                        payload_bytes=hit.byte_size,
                        entries=hit.entries,
                        frame=frame,
                    )
        if total > position:
            self.cache.count_misses(total - position)
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
        """Store ``frame`` under each record candidate of ``tokens`` (spec §5.2).

        Nothing is stored when the mode does not record, there are no tokens, fewer than
        ``min_tokens``, an empty payload, or a frame whose token count is not ``len(tokens)``.
        Each candidate stores a zero-copy prefix view of ``frame``; a candidate the frame cannot
        be cut at (opaque layout, side-band flags, ragged rows) is skipped alone.

        Args:
            config: The stage.
            base: The message envelope; ``chat_template_id`` is the cache namespace.
            token_start: Position of the first token.
            tokens: The prompt's token ids.
            activation_width: Width of the activation rows; part of the cache key.
            frame: This stage's output for all of ``tokens``.

        Returns:
            One record per stored candidate, longest first, with the evictions it caused.

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
        counts = self.policy.record_candidate_token_counts(n)
        hashes = self._hashes(config, base, token_start, array, counts)
        records: list[ResidentActivationRecord] = []
        for count in counts:
            if frame.prefix_error(count) is not None:
                continue
            candidate = frame._cut(count)
            key = activation_page_id(page_id(config, token_start, count, hashes[count]), width)
            outcome = self.cache.record(key, count, candidate.payload.size, candidate)
            records.append(
                ResidentActivationRecord(
                    page_id=key,
                    token_count=count,
                    payload_bytes=candidate.payload.size,
                    evicted_entries=outcome.evicted_entries,
                    evicted_bytes=outcome.evicted_bytes,
                    entries=len(self.cache),
                    resident_bytes=self.cache.resident_bytes,
                    evicted=outcome.evicted,
                )
            )
        return records

    def clear(self) -> tuple[EvictedEntry, ...]:
        """Drop every cached frame; returns them with reason ``"cleared"``."""
        self._memo = None
        return self.cache.clear()

    def stats(self) -> ResidentCacheStats:
        """The cache's counters."""
        return self.cache.stats()

    # ----------------------------------------------------------------------------------------
    # helpers

    def _check(
        self,
        config: StageConfig,
        base: MessageBase,
        token_start: int,
        tokens: Sequence[int] | npt.NDArray[np.integer],
    ) -> TokenArray:
        if not isinstance(token_start, int | np.integer) or isinstance(token_start, bool):
            msg = f"token_start must be an integer, got {token_start!r}"
            raise ConfigError(msg)
        if not 0 <= token_start <= _U64_MAX:
            msg = f"token_start must be in [0, {_U64_MAX}], got {token_start}"
            raise ConfigError(msg)
        if not isinstance(config, StageConfig):
            msg = f"config must be a StageConfig, got {type(config).__name__}"
            raise ConfigError(msg)
        if not isinstance(base, MessageBase):
            msg = f"base must be a MessageBase, got {type(base).__name__}"
            raise ConfigError(msg)
        return as_token_array(tokens)

    def accounting(self) -> CacheAccounting:
        """Hits, misses by reason, restored tokens and resident vs unique-prefix bytes.

        Integrations built by :meth:`from_config` (both index modes) implement it.

        Raises:
            NotImplementedError: on a bare ``KvStageIntegration`` built by hand.
        """
        msg = "accounting() needs an integration built by KvStageIntegration.from_config"
        raise NotImplementedError(msg)

    def _filter_probes(
        self, base: MessageBase, token_start: int, width: int, array: TokenArray, probes: list[int]
    ) -> list[int]:
        """Drop probe lengths whose key cannot be resident (descending order kept).

        Subclasses that know more about the resident keys than their slots may rule out more;
        a dropped probe is counted as the miss it would be. None are dropped here.
        """
        return probes

    def _restore_extra_counts(
        self, base: MessageBase, token_start: int, width: int, array: TokenArray, counts: list[int]
    ) -> list[int]:
        """More lengths (among the lookup ``counts``) a restore should hash in its single pass.

        For subclasses that look at candidate keys after a restore; none here.
        """
        return []

    def _hashes(
        self,
        config: StageConfig,
        base: MessageBase,
        token_start: int,
        array: TokenArray,
        counts: list[int],
        *,
        more: Callable[[], list[int]] | None = None,
    ) -> dict[int, str]:
        """Prefix hashes for ``counts``, bound to ``base.cache_salt`` when it is set (issue 6).

        ``more`` names lengths worth adding to a hashing pass if one is needed anyway (they are
        not computed, nor hashed, when the memo already holds every one of ``counts``).
        """
        hashes = self._unsalted_hashes(config, base, token_start, array, counts, more)
        if base.cache_salt is None:
            return hashes
        return salted_prefix_hashes({c: hashes[c] for c in counts}, base.cache_salt)

    def _unsalted_hashes(
        self,
        config: StageConfig,
        base: MessageBase,
        token_start: int,
        array: TokenArray,
        counts: list[int],
        more: Callable[[], list[int]] | None = None,
    ) -> dict[int, str]:
        """Prefix hashes for ``counts``, reusing those of the previous prompt when it matches.

        The memo is keyed on the token contents (compared against a private copy), so a caller
        mutating its array between calls gets fresh hashes. Missing counts of a matching prompt
        are added by one more pass.
        """
        namespace = base.chat_template_id
        memo = self._memo
        if memo is not None and memo.matches(config, token_start, namespace, array):
            known = memo.hashes
            missing = [count for count in counts if count not in known]
            if missing:
                if more is not None:
                    missing += [count for count in more() if count not in known]
                known.update(prefix_hashes(config, token_start, array, missing, namespace))
            return known
        if more is not None:
            counts = counts + more()
        hashes = prefix_hashes(config, token_start, array, counts, namespace)
        private = array.copy()
        private.flags.writeable = False  # never changes: subclasses may keep it
        self._memo = _HashMemo(
            config=config,
            token_start=token_start,
            namespace=namespace,
            tokens=private,
            hashes=hashes,
        )
        return hashes

    def _identity(
        self,
        config: StageConfig,
        base: MessageBase,
        token_start: int,
        array: TokenArray,
        count: int,
        hash_: str,
    ) -> PrefillKvIdentity:
        namespace = base.chat_template_id
        identity = PageIdentity(
            model_id=config.model_id,
            topology_id=config.topology_id,
            stage_id=config.stage_id,
            stage_index=config.stage_index,
            layer_start=config.layer_start,
            layer_end=config.layer_end,
            prefix_hash=hash_,
            session_id=base.session_id,
            token_start=token_start,
            token_count=count,
            tokenizer_id=base.tokenizer_id if base.tokenizer_id is not None else config.model_id,
            chat_template_id=namespace or "",
            position_config_hash=f"ctx:{config.ctx_size}",
        )
        return PrefillKvIdentity(
            identity=identity,
            page_id=page_id(config, token_start, count, hash_),
            namespace=prefix_namespace_hash(config, token_start, namespace),
            token_ids=_readonly(array[:count]),
        )


def activation_key_slot(key: str) -> tuple[tuple[str, str], int] | None:
    """``((token_start, "w{width}"), token_count)`` of an ``act:`` key, or None for other keys.

    The cache's :data:`~stage_runtime.cache.KeyIndex` for activation keys
    ``act:{stage}:{start}:{count}:{layer_start}:{digest}:w{width}`` (the stage id may itself
    contain colons, so the key is split from the right).
    """
    if not key.startswith("act:"):
        return None
    parts = key.rsplit(":", 5)
    if len(parts) != 6 or not parts[5].startswith("w"):
        return None
    try:
        count = int(parts[2])
    except ValueError:
        return None
    return (parts[1], parts[5]), count


def _check_width(width: object) -> int:
    if not isinstance(width, int | np.integer) or isinstance(width, bool):
        msg = f"activation_width must be an integer, got {width!r}"
        raise ConfigError(msg)
    if not 0 <= width <= _I32_MAX:
        msg = f"activation_width must be in [0, {_I32_MAX}], got {width}"
        raise ConfigError(msg)
    return int(width)
