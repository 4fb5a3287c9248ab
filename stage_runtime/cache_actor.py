"""The cache actor: the one task that owns a stage's activation cache.

A :class:`CacheActor` holds one :class:`~stage_runtime.cache.StageCache` (built from the
stage's :class:`~stage_runtime.config.StageConfig`); nothing else references it.
Every access is a message handled one at a time, so no lock is needed:

- :class:`RestoreActivation`: ``ResidentActivationRestore | None`` (longest validated prefix);
- :class:`RestoreActivationPages`: the same hit page by page, nothing joined
  (``ActivationRestore | None``, whatever the index: what a stage asks);
- :class:`RecordActivation`: ``list[ResidentActivationRecord]`` (one per ladder rung recorded);
- :class:`CacheStatsRequest`: :class:`CacheStats` ``| None`` (None when caching is disabled);
- :class:`ClearCache`: ``tuple[EvictedEntry, ...]`` (reason ``"cleared"``).

Each message class declares its reply type (:class:`actors.Asks`), so ``await ref.ask(...)`` is
typed per message.

Each record, restore, miss and eviction is a structlog event; run the actor inside a task that
bound ``stage=`` with :func:`structlog.contextvars.bound_contextvars` (a stage does) and every
event carries it. ``activation_missed`` carries the miss's ``reason`` (``never_seen``,
``evicted`` or ``rejected``) in both index modes.

A malformed message (wrong field types, a token array that is not integers, a frame that is not
an :class:`~stage_runtime.frames.ActivationFrame` or does not cover exactly the message's tokens)
raises a typed error in the caller's ``ask`` (:class:`~stage_runtime.errors.ConfigError` or
:class:`~stage_runtime.errors.FrameError`), is logged by the actor toolkit, and leaves the cache
unchanged; the actor keeps running.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping, Sequence
from collections.abc import Set as AbstractSet
from typing import Any, cast

import attrs
import numpy as np
import numpy.typing as npt
import structlog

from actors import Actor, Asks
from stage_runtime._validators import check_non_negative_int
from stage_runtime.accounting import CacheAccounting
from stage_runtime.cache import EvictedEntry, ResidentCacheStats
from stage_runtime.cache.results import (
    ActivationRestore,
    ResidentActivationRecord,
    ResidentActivationRestore,
)
from stage_runtime.cache.stage_cache import StageCache
from stage_runtime.config import MessageBase, StageConfig
from stage_runtime.errors import ConfigError, FrameError
from stage_runtime.frames import ActivationFrame
from stage_runtime.identity import _frozen, as_token_array

__all__ = [
    "CacheActor",
    "CacheMessage",
    "CacheStats",
    "CacheStatsRequest",
    "ClearCache",
    "RecordActivation",
    "RestoreActivation",
    "RestoreActivationPages",
]

log = structlog.get_logger(__name__)

# Decision values, as the upstream names them (spec §7).
DECISION_HIT = "activation_resident_hit"
DECISION_PREFIX_SHORT = "activation_hit_prefix_short"
DECISION_MISS = "activation_resident_miss"
DECISION_RECORD = "activation_record"


def _snapshot(
    tokens: Sequence[int] | npt.NDArray[np.integer[Any]] | Iterable[int],
) -> npt.NDArray[np.int32]:
    """A message's tokens as they are when it is made: a message can wait in a mailbox (a
    ``tell``, or an ``ask`` whose caller was cancelled), and a caller reusing its buffer for
    the next prompt meanwhile would change the prompt the actor sees. A read-only array that
    owns its data (what :meth:`Pipeline.prefill` makes) and immutable sequences (tuple, range)
    are kept as they are; any other array or iterable (list, ``array.array``, memoryview,
    deque, ...) is copied. Validation is the actor's, when it handles the message: what is not
    an iterable of tokens at all (None, a string, a set, a mapping) is passed on as it is, for
    the actor to name."""
    if isinstance(tokens, np.ndarray):
        if not _frozen(tokens):
            return cast("npt.NDArray[np.int32]", tokens.copy())
        return cast("npt.NDArray[np.int32]", tokens)
    if isinstance(tokens, tuple | range | str | bytes | AbstractSet | Mapping) or not isinstance(
        tokens, Iterable
    ):
        return cast("npt.NDArray[np.int32]", tokens)
    return cast("npt.NDArray[np.int32]", list(tokens))  # checked by the actor


@attrs.frozen(kw_only=True, eq=False)
class _RestoreFields:
    base: MessageBase
    """Request metadata; its ``chat_template_id`` is the cache namespace."""

    tokens: npt.NDArray[np.int32] = attrs.field(converter=_snapshot)
    """The prompt's token ids (1-D int32; other integer sequences are converted). Taken as
    they are when the message is made: a writable array or a list is copied."""

    activation_width: int
    """Width in the cache key; a different width never hits."""

    token_start: int = 0
    """Position of ``tokens[0]`` in the sequence (0 for a prefill)."""


@attrs.frozen(kw_only=True, eq=False)
class RestoreActivation(_RestoreFields, Asks[ResidentActivationRestore | None]):
    """Restore the longest cached prefix of ``tokens`` (longest lookup candidate first), as
    one frame."""


@attrs.frozen(kw_only=True, eq=False)
class RestoreActivationPages(_RestoreFields, Asks[ActivationRestore | None]):
    """:class:`RestoreActivation`, but the hit comes page by page (an
    :class:`~stage_runtime.cache.ActivationRestore`: views of the cached rows, nothing joined),
    so the caller can join them off the event loop; what a stage asks, whatever its index."""


@attrs.frozen(kw_only=True, eq=False)
class RecordActivation(Asks[list[ResidentActivationRecord]]):
    """Record ``frame`` (the stage's full output for ``tokens``) at every ladder rung."""

    base: MessageBase
    """Request metadata; its ``chat_template_id`` is the cache namespace."""

    tokens: npt.NDArray[np.int32] = attrs.field(converter=_snapshot)
    """The prompt's token ids (1-D int32; other integer sequences are converted). Taken as
    they are when the message is made: a writable array or a list is copied."""

    activation_width: int
    """Width in the cache key."""

    frame: ActivationFrame
    """The output frame covering all of ``tokens``; stored as zero-copy prefix views."""

    token_start: int = 0
    """Position of ``tokens[0]`` in the sequence (0 for a prefill)."""


_STAGE_BUILT = (
    "only a stage builds this message (unchecked); send RestoreActivationPages or RecordActivation"
)


@attrs.frozen(kw_only=True, eq=False, init=False)
class _StageRestore(RestoreActivationPages):
    """A stage's own :class:`RestoreActivationPages`, which the actor takes as it is: the stage
    builds it unchecked only from values it has checked (a read-only 1-D int32 array of tokens
    that owns its data, its model's checked ``activation_width``, an envelope of checked ids,
    ``token_start`` 0). Checking them again cost a stage about 1 us per request. It cannot be
    made otherwise: its constructor refuses."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        raise TypeError(_STAGE_BUILT)


@attrs.frozen(kw_only=True, eq=False, init=False)
class _StageRecord(RecordActivation):
    """A stage's own :class:`RecordActivation`, taken as it is (see :class:`_StageRestore`);
    its frame is the stage's output, which the stage has checked covers the tokens in rows
    ``activation_width`` wide (checking the frame again cost about 1.5 us per request)."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        raise TypeError(_STAGE_BUILT)


@attrs.frozen(kw_only=True)
class CacheStatsRequest(Asks["CacheStats | None"]):
    """Ask for the cache's counters; replies :class:`CacheStats` or None when disabled."""


@attrs.frozen(kw_only=True)
class CacheStats(ResidentCacheStats):
    """A stage cache's counters plus its accounting (the reply to :class:`CacheStatsRequest`).

    The inherited fields are the store's own counters, as before; in ladder mode ``lookups``,
    ``hits`` and ``misses`` count candidate probes (several per restore), in paged mode restore
    calls. ``accounting`` counts restore calls in both modes, with misses by reason.
    """

    accounting: CacheAccounting
    """Lookups, hits, misses by reason, restored tokens, resident vs unique-prefix bytes."""


@attrs.frozen(kw_only=True)
class ClearCache(Asks[tuple[EvictedEntry, ...]]):
    """Evict every entry (each logged with reason ``"cleared"``); replies the evicted entries."""


def _check_common(
    message: _RestoreFields | RecordActivation,
) -> tuple[npt.NDArray[np.int32], int, int]:
    """Validate the fields both messages share; return the tokens as an int32 array, the
    token start and the activation width (numpy integers as ints)."""
    if not isinstance(message.base, MessageBase):
        msg = f"base must be a MessageBase, got {type(message.base).__name__}"
        raise ConfigError(msg)
    width = message.activation_width
    if type(width) is not int or width < 0:  # (plain ints, the usual case, need no more)
        width = check_non_negative_int("activation_width", width, numpy=True)
    start = message.token_start
    if type(start) is not int or start < 0:
        start = check_non_negative_int("token_start", start, numpy=True)
    tokens = message.tokens
    if not (isinstance(tokens, np.ndarray) and tokens.dtype == np.int32 and tokens.ndim == 1):
        tokens = as_token_array(tokens)  # else the pipeline validated it once at entry
    return tokens, start, width


CacheMessage = (
    RestoreActivation | RestoreActivationPages | RecordActivation | CacheStatsRequest | ClearCache
)
"""Every message a :class:`CacheActor` understands."""


class CacheActor(Actor[CacheMessage, Any]):
    """Owns one stage's activation cache; see the module docstring for the messages.

    Args:
        config: The stage's configuration; the cache is built from it
            (:meth:`StageCache.from_config`), and it is part of every cache key.
        environ: Environment consulted when ``config.kv_cache`` is None (spec §6.1); the process
            environment when None.
    """

    def __init__(self, config: StageConfig, *, environ: Mapping[str, str] | None = None) -> None:
        self._config = config
        self._cache = StageCache.from_config(config, environ=environ)
        # Bound once (not per event), with the levels it lets through: an event whose level
        # is filtered out is not even built.
        self._log = log.bind()
        self._debug = _enabled(self._log, logging.DEBUG)
        self._info = _enabled(self._log, logging.INFO)

    @property
    def should_lookup(self) -> bool:
        """Whether restores can ever hit (the mode looks up); fixed for the actor's life."""
        return self._cache is not None and self._cache.should_lookup()

    @property
    def should_record(self) -> bool:
        """Whether records can ever store anything; fixed for the actor's life."""
        return self._cache is not None and self._cache.should_record()

    def handle(self, message: CacheMessage) -> Any:
        """Apply one message to the cache and return its reply."""
        kind = type(message)
        # (Annotated, not cast(): cast is a call, two per request and stage.)
        if kind is _StageRestore:  # (a stage's own: its fields checked by the stage)
            asked: _StageRestore = message  # type: ignore[assignment]
            return self._lookup(asked, asked.tokens, asked.token_start, asked.activation_width)
        if kind is _StageRecord:
            told: _StageRecord = message  # type: ignore[assignment]
            return self._store(
                told, told.tokens, told.token_start, told.activation_width, told.frame
            )
        if isinstance(message, _RestoreFields):
            return self._restore(message)
        if isinstance(message, RecordActivation):
            return self._record(message)
        if isinstance(message, CacheStatsRequest):
            return self._stats()
        if isinstance(message, ClearCache):
            return self._clear()
        msg = (
            "message must be RestoreActivation, RestoreActivationPages, RecordActivation, "
            f"CacheStatsRequest or ClearCache, got {type(message).__name__}"
        )
        raise ConfigError(msg)

    def _restore(
        self, message: _RestoreFields
    ) -> ResidentActivationRestore | ActivationRestore | None:
        tokens, start, width = _check_common(message)
        return self._lookup(message, tokens, start, width)

    def _lookup(
        self,
        message: _RestoreFields,
        tokens: npt.NDArray[np.int32],
        start: int,
        width: int,
    ) -> ResidentActivationRestore | ActivationRestore | None:
        """:meth:`_restore` of checked fields."""
        cache = self._cache
        if cache is None or not cache.should_lookup() or tokens.size == 0:
            return None
        # StageCache.restore, unrolled: a call less per request.
        restore = cache.restore_prompt(
            cache.prompt(cache.config, message.base, start, tokens, width)
        )
        if self._debug:
            self._log_restore(message.base, int(tokens.size), restore)
        if restore is None or isinstance(message, RestoreActivationPages):
            return restore
        return restore.to_restore()

    def _log_restore(
        self, base: MessageBase, requested: int, restore: ActivationRestore | None
    ) -> None:
        assert self._cache is not None
        if restore is None:
            self._log.debug(
                "activation_missed",
                **_request_of(base),
                requested_tokens=requested,
                candidates_tried=self._cache.lookup_candidates(requested),
                decision=DECISION_MISS,
                reason=self._cache.last_miss_reason or "never_seen",
            )
            return
        self._log.debug(
            "activation_restored",
            **_request_of(base),
            page_id=restore.page_id,
            token_count=restore.token_count,
            requested_tokens=requested,
            payload_bytes=restore.payload_bytes,
            decision=DECISION_HIT if restore.token_count >= requested else DECISION_PREFIX_SHORT,
        )

    def _record(self, message: RecordActivation) -> list[ResidentActivationRecord]:
        tokens, start, width = _check_common(message)
        frame = message.frame
        if not isinstance(frame, ActivationFrame):
            msg = f"frame must be an ActivationFrame, got {type(frame).__name__}"
            raise FrameError(msg)
        if frame.token_count != tokens.size:
            # The core would store nothing (all or nothing, spec §5.2); a message that pairs a
            # frame with other tokens is a caller's bug, so the caller hears about it.
            msg = f"frame must cover the {tokens.size} tokens, got {frame.token_count} tokens"
            raise FrameError(msg)
        # (The core, like the upstream's, does not look: the seed's own tests record 1-wide
        # rows under width 4,096.)
        frame.check_row_width(width, what="frame")
        return self._store(message, tokens, start, width, frame)

    def _store(
        self,
        message: RecordActivation,
        tokens: npt.NDArray[np.int32],
        start: int,
        width: int,
        frame: ActivationFrame,
    ) -> list[ResidentActivationRecord]:
        """:meth:`_record` of checked fields."""
        cache = self._cache
        if cache is None or not cache.should_record():
            return []
        # StageCache.record, unrolled: a call less per request.
        prompt = cache.prompt(cache.config, message.base, start, tokens, width)
        records = cache.record_prompt(prompt, frame)
        if not (self._info or self._debug):
            return records
        request = _request_of(message.base)
        for record in records:
            if self._info:
                _log_evictions(self._log, record.evicted, request)
            if not self._debug:
                continue
            self._log.debug(
                "activation_recorded",
                **request,
                page_id=record.page_id,
                token_count=record.token_count,
                payload_bytes=record.payload_bytes,
                entries=record.entries,
                resident_bytes=record.resident_bytes,
                decision=DECISION_RECORD,
            )
        return records

    def _stats(self) -> CacheStats | None:
        if self._cache is None:
            return None
        counters = attrs.asdict(self._cache.statistics(), recurse=False)
        return CacheStats(**counters, accounting=self._cache.accounting())

    def _clear(self) -> tuple[EvictedEntry, ...]:
        if self._cache is None:
            return ()
        evicted = self._cache.clear()
        if self._info:
            _log_evictions(self._log, evicted)
        return evicted


def _request_of(base: MessageBase) -> dict[str, str]:
    """``request_id=`` for a message's log events when it names its request (the stage's do),
    so that its restores, records and the evictions it caused can be told apart under load."""
    return {"request_id": base.request_id} if base.request_id else {}


def _enabled(logger: Any, level: int) -> bool:
    """Whether ``logger`` lets events of ``level`` through (True when it cannot say)."""
    enabled = getattr(logger, "is_enabled_for", None)
    return enabled is None or bool(enabled(level))


def _log_evictions(
    logger: Any, evicted: Sequence[EvictedEntry], request: Mapping[str, str] | None = None
) -> None:
    """One ``activation_evicted`` event per entry, with the cache's size right after it left
    (and the ``request_id`` of the record that caused it, when there is one).

    The size comes from the index itself (``entries_after``/``resident_bytes_after``): one paged
    record stores several pages and (under ``reuse`` eviction) may evict between them, so it
    cannot be reconstructed from the sizes before and after the call. A paged record may evict
    hundreds of pages: the caller checks first that ``logger`` lets info events through.
    """
    info = logger.info
    for entry in evicted:
        info(
            "activation_evicted",
            **(request or {}),
            page_id=entry.key,
            token_count=entry.token_count,
            payload_bytes=entry.payload_bytes,
            reason=entry.reason,
            entries=entry.entries_after,
            resident_bytes=entry.resident_bytes_after,
        )
