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

from collections.abc import Mapping, Sequence
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
from stage_runtime.cache.ladder import LadderIndex
from stage_runtime.cache.prompt import Prompt, owned_tokens
from stage_runtime.cache.results import (
    ActivationRecordSummary,
    PageIdentity,
    PrefillKvIdentity,
    ResidentActivationRecord,
    ResidentActivationRestore,
    prefill_kv_identity,
    summarize_records,
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
    TokenArray,
    as_token_array,
)
from stage_runtime.limits import I32_MAX as _I32_MAX
from stage_runtime.limits import U64_MAX as _U64_MAX
from stage_runtime.policy import CandidatePolicy, derive_max_resident_tokens

__all__ = [
    "ActivationRecordSummary",
    "KvStageIntegration",
    "PageIdentity",
    "PrefillKvIdentity",
    "ResidentActivationRecord",
    "ResidentActivationRestore",
    "effective_cache_payload",
    "summarize_records",
]


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

    _last_prompt: Prompt | None = attrs.field(default=None, init=False, repr=False)
    _ladder: LadderIndex = attrs.field(init=False, repr=False)

    def __attrs_post_init__(self) -> None:
        self._ladder = LadderIndex(self.cache_config, self.policy, store=self.cache)

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
        ladder = self._ladder
        ladder.probe_all = self.probe_all
        found = ladder.restore(self._prompt(config, base, int(token_start), array, width))
        self.last_miss_reason = ladder.last_miss_reason
        return found

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
        if not self.should_record() or array.size == 0:
            return []
        return self._ladder.record(
            self._prompt(config, base, int(token_start), array, width), frame
        )

    def clear(self) -> tuple[EvictedEntry, ...]:
        """Drop every cached frame; returns them with reason ``"cleared"``."""
        self._last_prompt = None
        return self._ladder.clear()

    def stats(self) -> ResidentCacheStats:
        """The cache's counters."""
        return self.cache.stats()

    def accounting(self) -> CacheAccounting:
        """Hits, misses by reason, restored tokens and resident vs unique-prefix bytes."""
        return self._ladder.accounting()

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

    def _prompt(
        self,
        config: StageConfig,
        base: MessageBase,
        token_start: int,
        array: TokenArray,
        width: int,
    ) -> Prompt:
        """The prompt of a call: the previous call's when it has the same keys and tokens (a
        restore then the record of one prompt hash it once)."""
        last = self._last_prompt
        if (
            last is not None
            and last.same_request(config, base, token_start, width)
            and (
                last.tokens is array
                or (last.n == array.size and bool(np.array_equal(last.tokens, array)))
            )
        ):
            if last.base is not base:
                last = Prompt(config, base, token_start, last.tokens, width, hashes=last.hashes)
                self._last_prompt = last
            return last
        prompt = Prompt(config, base, token_start, owned_tokens(array), width)
        self._last_prompt = prompt
        return prompt

    def _hashes(
        self,
        config: StageConfig,
        base: MessageBase,
        token_start: int,
        array: TokenArray,
        counts: list[int],
    ) -> dict[int, str]:
        """Prefix hashes for ``counts``, bound to ``base.cache_salt`` when it is set (issue 6)."""
        prompt = self._prompt(config, base, int(token_start), array, 0)
        hashes = prompt.hash_counts(counts)
        return {c: hashes[c] for c in counts}

    def _identity(
        self,
        config: StageConfig,
        base: MessageBase,
        token_start: int,
        array: TokenArray,
        count: int,
        hash_: str,
    ) -> PrefillKvIdentity:
        return prefill_kv_identity(config, base, token_start, array, count, hash_)


def _check_width(width: object) -> int:
    if not isinstance(width, int | np.integer) or isinstance(width, bool):
        msg = f"activation_width must be an integer, got {width!r}"
        raise ConfigError(msg)
    if not 0 <= width <= _I32_MAX:
        msg = f"activation_width must be in [0, {_I32_MAX}], got {width}"
        raise ConfigError(msg)
    return int(width)
