"""A stage's activation cache: its settings, validated once, and the one index it owns.

:class:`StageCache` is what a stage's cache actor holds. It resolves the stage's cache settings
(spec §6: the ``kv_cache`` block or the environment, the kill switch, the record ladder's token
budget), builds the index they name (:func:`build_index`), validates every argument at its
boundary (so an index never sees bad input, and a rejected call leaves the cache exactly as it
was) and keeps the last prompt it saw, so a restore and the record of the same prompt share their
hashing. Single owner, synchronous, no trio.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Final

import attrs
import numpy as np
import numpy.typing as npt

from stage_runtime._validators import check_int
from stage_runtime.accounting import CacheAccounting, MissReason
from stage_runtime.cache.index import ActivationIndex
from stage_runtime.cache.ladder import LadderIndex
from stage_runtime.cache.paged.stage_index import PagedIndex
from stage_runtime.cache.prompt import Prompt, owned_tokens
from stage_runtime.cache.resident import EvictedEntry, ResidentCacheStats
from stage_runtime.cache.results import ActivationRestore, ResidentActivationRecord
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
from stage_runtime.identity import _TOKEN_DTYPE, TokenArray, as_token_array
from stage_runtime.limits import I32_MAX, U64_MAX
from stage_runtime.policy import CandidatePolicy, derive_max_resident_tokens

__all__ = ["StageCache", "build_index", "effective_cache_payload"]

# Substrings of model ids whose architectures keep recurrent state (spec §6 fallback table).
_RECURRENT_MARKERS = (
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


def build_index(cache_config: KvCacheConfig, policy: CandidatePolicy) -> ActivationIndex:
    """The index ``cache_config.index`` names, built from the settings."""
    if cache_config.index is CacheIndex.PAGED:
        return PagedIndex(cache_config)
    return LadderIndex(cache_config, policy)


class StageCache:
    """One stage's activation cache. Build it with :meth:`from_config`.

    Args:
        config: The stage; part of every cache key.
        cache_config: The cache settings (already resolved: a mode that caches).
        policy: The lookup grid and record ladder.
        index: The index; the one ``cache_config.index`` names when None.
    """

    __slots__ = ("_last", "cache_config", "config", "healthy", "index", "mode", "payload", "policy")

    def __init__(
        self,
        config: StageConfig,
        cache_config: KvCacheConfig,
        policy: CandidatePolicy,
        index: ActivationIndex | None = None,
    ) -> None:
        if not isinstance(config, StageConfig):
            msg = f"config must be a StageConfig, got {type(config).__name__}"
            raise ConfigError(msg)
        self.config = config
        self.cache_config = cache_config
        self.mode: CacheMode = cache_config.mode
        """``record`` or ``lookup-record``."""
        self.payload = effective_cache_payload(cache_config.payload, config.model_id)
        """The resolved payload kind (informational for activations)."""
        self.policy = policy
        self.index: ActivationIndex = build_index(cache_config, policy) if index is None else index
        self.healthy = True
        """Cleared to stop all lookups and records (the upstream's V-E health gate)."""
        self._last: Prompt | None = None

    @classmethod
    def from_config(
        cls, config: StageConfig, *, environ: Mapping[str, str] | None = None
    ) -> StageCache | None:
        """The cache of a stage, or None when its cache is disabled (spec §6).

        Settings come from ``config.kv_cache``, or from the environment when that is None
        (:meth:`KvCacheConfig.from_env`). None is returned when there are no settings, the mode is
        ``disabled`` or ``auto``, or the kill switch is engaged (``STAGE_RUNTIME_KV_CACHE`` or
        ``STAGE_RUNTIME_PREFIX_CACHE`` set to ``off`` and friends), even with a ``kv_cache`` block.
        The record ladder's token budget is derived from ``config.ctx_size`` (spec §6.2).

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
        return cls(config, cache_config, policy)

    # ---------------------------------------------------------------------------------- modes

    def should_lookup(self) -> bool:
        """Whether restores look anything up (``lookup-record`` mode, healthy)."""
        return self.healthy and self.mode is CacheMode.LOOKUP_RECORD

    def should_record(self) -> bool:
        """Whether records store anything (``record`` or ``lookup-record`` mode, healthy)."""
        return self.healthy and self.mode in _RECORDING

    def lookup_candidates(self, token_count: int) -> int:
        """Lookups a restore of ``token_count`` tokens counts (the ladder's whole grid; one
        walk of the page chain for the paged index)."""
        return self.index.lookup_candidates(token_count)

    @property
    def last_miss_reason(self) -> MissReason | None:
        """Why the latest restore that looked something up restored nothing; None after a hit."""
        return self.index.last_miss_reason

    # -------------------------------------------------------------------- restore and record

    def restore(
        self,
        base: MessageBase,
        tokens: Sequence[int] | npt.NDArray[np.integer[Any]] | Iterable[int],
        activation_width: int,
        *,
        token_start: int = 0,
    ) -> ActivationRestore | None:
        """The longest cached prefix of ``tokens``, or None (spec §5.1; see the index).

        Raises:
            ConfigError: a bad argument; the cache is left unchanged.
        """
        prompt = self.prompt(self.config, base, token_start, tokens, activation_width)
        return self.restore_prompt(prompt)

    def restore_prompt(self, prompt: Prompt) -> ActivationRestore | None:
        """:meth:`restore` of a prompt built by :meth:`prompt`."""
        if prompt.n == 0 or not (self.healthy and self.mode is CacheMode.LOOKUP_RECORD):
            return None  # (not should_lookup(): a call less per request)
        return self.index.restore(prompt)

    def record(
        self,
        base: MessageBase,
        tokens: Sequence[int] | npt.NDArray[np.integer[Any]] | Iterable[int],
        activation_width: int,
        frame: ActivationFrame,
        *,
        token_start: int = 0,
    ) -> list[ResidentActivationRecord]:
        """Store ``frame``, this stage's output for all of ``tokens`` (spec §5.2; see the
        index). Nothing is stored when the mode does not record, there are no tokens, fewer than
        ``min_tokens``, an empty payload, or a frame whose token count is not ``len(tokens)``.

        Raises:
            ConfigError: a bad argument; the cache is left unchanged.
            FrameError: ``frame`` is not an ActivationFrame; the cache is left unchanged.
        """
        prompt = self.prompt(self.config, base, token_start, tokens, activation_width)
        return self.record_prompt(prompt, frame)

    def record_prompt(
        self, prompt: Prompt, frame: ActivationFrame
    ) -> list[ResidentActivationRecord]:
        """:meth:`record` of a prompt built by :meth:`prompt`."""
        if not isinstance(frame, ActivationFrame):
            msg = f"frame must be an ActivationFrame, got {type(frame).__name__}"
            raise FrameError(msg)
        if prompt.n == 0 or not (self.healthy and self.mode in _RECORDING):
            return []  # (not should_record(): a call less per request)
        return self.index.record(prompt, frame)

    def clear(self) -> tuple[EvictedEntry, ...]:
        """Drop every cached frame; returns them with reason ``"cleared"``."""
        self._last = None
        return self.index.clear()

    def statistics(self) -> ResidentCacheStats:
        """The index's counters."""
        return self.index.statistics()

    def accounting(self) -> CacheAccounting:
        """Hits, misses by reason, restored tokens and resident vs unique-prefix bytes."""
        return self.index.accounting()

    # ---------------------------------------------------------------------------- the prompt

    def prompt(
        self,
        config: StageConfig,
        base: MessageBase,
        token_start: int,
        tokens: Sequence[int] | npt.NDArray[np.integer[Any]] | Iterable[int],
        activation_width: int,
    ) -> Prompt:
        """The validated prompt of a call: the previous call's when it has the same keys and
        the same tokens (a restore then the record of one prompt hash it once). ``config`` is
        the stage's own except through the seed-parity API, which names it on every call.

        Raises:
            ConfigError: a bad argument.
        """
        last = self._last
        if (
            last is not None
            and last.tokens is tokens
            and last.base is base
            and last.config is config
            and last.token_start == token_start
            and last.width == activation_width
            and type(token_start) is int
            and type(activation_width) is int
        ):
            # The record of the prompt just restored (its arguments were checked then).
            return last
        # (Plain ints in range, the usual case, skip the general checks.)
        start = (
            token_start
            if type(token_start) is int and 0 <= token_start <= U64_MAX
            else _check_start(token_start)
        )
        if config is not self.config and not isinstance(config, StageConfig):
            msg = f"config must be a StageConfig, got {type(config).__name__}"
            raise ConfigError(msg)
        if type(base) is not MessageBase and not isinstance(base, MessageBase):
            msg = f"base must be a MessageBase, got {type(base).__name__}"
            raise ConfigError(msg)
        if (
            type(tokens) is np.ndarray
            and tokens.dtype == _TOKEN_DTYPE
            and tokens.ndim == 1
            and tokens.flags.c_contiguous
        ):
            array: TokenArray = tokens  # type: ignore[assignment]  # (as_token_array's answer)
        else:
            array = as_token_array(tokens)
        width = (
            activation_width
            if type(activation_width) is int and 0 <= activation_width <= I32_MAX
            else _check_width(activation_width)
        )
        if (
            last is not None
            and last.n == array.size
            and (last.tokens is array or bool(np.array_equal(last.tokens, array)))
            and last.same_request(config, base, start, width)
        ):
            if last.base is not base:
                last = Prompt(config, base, start, last.tokens, width, hashes=last.hashes)
                self._last = last
            return last
        prompt = Prompt(config, base, start, owned_tokens(array), width)
        self._last = prompt
        return prompt

    def forget_prompt(self) -> None:
        """Forget the last prompt (its hashes are computed again if it comes back)."""
        self._last = None


_RECORDING: Final = (CacheMode.RECORD, CacheMode.LOOKUP_RECORD)
"""The modes that record."""


def _check_start(token_start: object) -> int:
    return check_int("token_start", token_start, low=0, high=U64_MAX, numpy=True)


def _check_width(width: object) -> int:
    return check_int("activation_width", width, low=0, high=I32_MAX, numpy=True)
