"""Replay a workload through a real pipeline of simulated stages, in virtual time.

The requests go through :func:`~stage_runtime.pipeline.open_pipeline` exactly as a server's
would: every stage restores, computes (a :class:`~stage_runtime.sim.model.SimulatedStageModel`),
records with the ladder, and forwards. Payloads are virtual and time is virtual, so a
61-million-token trace replays in seconds and fits in memory.

Requests are admitted into stage 0 in :func:`admission_order` and every stage serves them one at
a time in that order, so what a stage restores depends on that order alone, never on timing.
The times are computed afterwards from what each stage restored and computed per request
(:func:`summarise_replay`):

- ``concurrency == 1``: requests in workload (file) order, each finishing at every stage before
  the next starts. A request's time to first token is the sum of its stages' costs; the models
  skip their sleeps (``virtual_time=True`` sleeps anyway).
- ``concurrency > 1``: requests arrive at their timestamps, by arrival, with at most
  ``concurrency`` in flight; their times are those of single-server FIFO stages
  (:func:`~stage_runtime.sim.cost.pipeline_finish_times`). The models sleep their costs on the
  (virtual) clock, so the pipeline runs as it would serve them.

Because stages are independent given that order, a replay also fans out: one unit per stage
(and per capacity of a sweep) in processes of their own (:mod:`stage_runtime.sim.fanout`), with
results identical to a one-process run.
"""

from __future__ import annotations

import math
import numbers
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any, Final

import attrs
import numpy as np
import numpy.typing as npt
import trio

from stage_runtime._validators import at_least, check_int, is_int
from stage_runtime.accounting import CacheAccounting
from stage_runtime.config import (
    CacheIndex,
    CacheMode,
    CachePayload,
    KvCacheConfig,
    PageEviction,
    StageConfig,
)
from stage_runtime.errors import ConfigError, shown
from stage_runtime.limits import (
    MAX_ARRIVAL_SPAN_S,
    MAX_BLOCK_SIZE,
    MAX_BYTES_PER_TOKEN,
    MAX_CACHE_BYTES,
    MAX_STAGES,
    MIN_BLOCK_SIZE,
    SIM_CTX_SIZE,
)
from stage_runtime.pipeline import Pipeline, PrefillResult, open_pipeline
from stage_runtime.policy import CandidatePolicy
from stage_runtime.sim.blocks import BlockTokenizer
from stage_runtime.sim.clairvoyant import (
    ClairvoyantResult,
    capacity_pages,
    clairvoyant_hits,
    plan_of,
)
from stage_runtime.sim.cost import CostModel, Percentiles, percentiles, pipeline_finish_times
from stage_runtime.sim.model import simulated_model_factory
from stage_runtime.sim.theory import TheoreticalMax, theoretical_max_hit_ratio
from stage_runtime.sim.trace import SimRequest, check_block_size
from stage_runtime.stage import StagePrefillReport

__all__ = [
    "MAX_BLOCK_SIZE",
    "MAX_BYTES_PER_TOKEN",
    "MAX_CACHE_BYTES",
    "MAX_ARRIVAL_SPAN_S",
    "MAX_STAGES",
    "MIN_BLOCK_SIZE",
    "PAGED_MAX_ENTRIES",
    "OfferedLoad",
    "ReplayResult",
    "RequestOutcome",
    "ProgressCallback",
    "SimConfig",
    "StageReplay",
    "StageSummary",
    "admission_order",
    "kv_cache_config",
    "replay",
    "stage_configs",
    "summarise_replay",
    "validate_requests",
]


ProgressCallback = Callable[[int], None]
"""Called with the number of finished requests after each one finishes (over every replay of a
sweep). A fanned-out replay calls it as each unit finishes, with the requests its finished
units amount to: each of a replay's stages counts for ``1 / stages`` of its requests."""


def _between(minimum: int, maximum: int) -> Callable[[object, attrs.Attribute[Any], Any], None]:
    check = at_least(minimum)

    def between(instance: object, attribute: attrs.Attribute[Any], value: Any) -> None:
        check(instance, attribute, value)
        if value > maximum:
            msg = f"{attribute.name} must be <= {maximum:,}, got {value:,}"
            raise ConfigError(msg)

    return between


def _optional_at_least(minimum: int) -> Callable[[object, attrs.Attribute[Any], Any], None]:
    check = at_least(minimum)

    def optional(instance: object, attribute: attrs.Attribute[Any], value: Any) -> None:
        if value is not None:
            check(instance, attribute, value)

    return optional


def _to_index(value: object) -> CacheIndex:
    if isinstance(value, CacheIndex):
        return value
    try:
        return CacheIndex(str(value))
    except ValueError:
        msg = f"index must be 'ladder' or 'paged', got {value!r}"
        raise ConfigError(msg) from None


def _to_eviction(value: object) -> PageEviction:
    if isinstance(value, str) and value in PageEviction.__members__.values():
        return PageEviction(value)
    msg = f"page_eviction must be 'lru', 'reuse' or 'adaptive', got {value!r}"
    raise ConfigError(msg)


PAGED_MAX_ENTRIES: Final = 1_000_000
"""Default :attr:`SimConfig.max_entries` with ``index="paged"``: every page is an entry, so
the ladder's 64 would hold 64 pages (32K tokens at 512 per page)."""


@attrs.frozen(kw_only=True)
class SimConfig:
    """Everything a replay depends on besides the requests (the CLI's flags)."""

    stages: int = attrs.field(default=4, validator=_between(1, MAX_STAGES))
    """Pipeline stages."""

    block_size: int = attrs.field(default=512, validator=_between(MIN_BLOCK_SIZE, MAX_BLOCK_SIZE))
    """Tokens per hash id."""

    min_tokens: int | None = attrs.field(default=None, validator=_optional_at_least(0))
    """Shortest cached prefix and lowest ladder rung; ``None``: the block size."""

    stride_tokens: int | None = attrs.field(default=None, validator=_optional_at_least(0))
    """Lookup-grid stride; ``None``: the block size (so the grid falls on block boundaries)."""

    record_limit: int = attrs.field(default=2, validator=at_least(0))
    """Prefix lengths one record stores (``0``: every grid length)."""

    capacity_tokens: int = attrs.field(default=0, validator=at_least(0))
    """Per-stage cache capacity in tokens (``max_bytes = capacity * bytes_per_token``; 0: none)."""

    bytes_per_token: int = attrs.field(default=8192, validator=_between(1, MAX_BYTES_PER_TOKEN))
    """Activation bytes per token (8,192: a 4,096-wide bf16 activation)."""

    concurrency: int = attrs.field(default=1, validator=at_least(1))
    """Requests in flight at once (1: file order, one at a time)."""

    cost: CostModel = attrs.field(factory=CostModel)
    """Virtual-time costs."""

    layers_per_stage: int = attrs.field(default=8, validator=at_least(1))
    """Layers each simulated stage holds (identity only)."""

    ctx_size: int = attrs.field(default=SIM_CTX_SIZE, validator=at_least(1))
    """Context size of every stage (identity, and the ladder's token budget when limit > 2)."""

    model_id: str = "sim/model"
    """Model id in every stage's configuration (identity only)."""

    index: CacheIndex = attrs.field(default=CacheIndex.LADDER, converter=_to_index)
    """Cache index: ``ladder`` (upstream) or ``paged`` (shared pages)."""

    _max_entries: int | None = attrs.field(
        default=None, alias="max_entries", validator=_optional_at_least(1)
    )
    """``max_entries`` as given (None: the index's default; kept as None so that
    ``attrs.evolve(config, index=...)`` gets the new index's default)."""

    @property
    def max_entries(self) -> int:
        """Entries per stage cache; by default 64 with the ladder (the upstream's default) and
        :data:`PAGED_MAX_ENTRIES` with pages, where every page is an entry and the capacity
        (``capacity_tokens``) does the bounding."""
        if self._max_entries is not None:
            return self._max_entries
        return PAGED_MAX_ENTRIES if self.index is CacheIndex.PAGED else 64

    page_tokens: int | None = attrs.field(default=None, validator=_optional_at_least(1))
    """Tokens per page with ``index="paged"``; ``None``: the stride. Refused with the ladder
    index, as ``--page-tokens`` is without ``--index paged``: the ladder then counts its
    unique-prefix bytes in pages of the stride."""

    page_eviction: PageEviction = attrs.field(default=PageEviction.LRU, converter=_to_eviction)
    """Paged mode's eviction: ``lru`` (default), ``reuse`` (weighs reuse and recompute saved)
    or ``adaptive`` (which pages come back, learnt from the workload). Another policy than
    ``lru`` with the ladder index is refused: the ladder evicts by LRU only (as in
    :class:`~stage_runtime.config.KvCacheConfig`)."""

    def __attrs_post_init__(self) -> None:
        if self.index is not CacheIndex.PAGED:
            # Refused here, not when the replay builds the stages' caches (page_eviction) or
            # never (page_tokens, which the ladder ignored without a word).
            paged_only = []
            if self.page_tokens is not None:
                paged_only.append(f"page_tokens {self.page_tokens}")
            if self.page_eviction is not PageEviction.LRU:
                paged_only.append(f"page_eviction {self.page_eviction.value!r}")
            if paged_only:
                verb = "apply" if len(paged_only) > 1 else "applies"
                msg = (
                    f"{' and '.join(paged_only)} {verb} to index 'paged' only "
                    f"(index is {self.index.value!r})"
                )
                raise ConfigError(msg)
        per_stage = len(self.cost.stage_prefill_s_per_token)
        if per_stage and per_stage != self.stages:
            msg = (
                f"cost.stage_prefill_s_per_token must have one cost per stage ({self.stages}), "
                f"got {per_stage}"
            )
            raise ConfigError(msg)
        self.check_capacity(self.capacity_tokens)
        if self.stride == 0 and self.record_limit > 0:
            msg = (
                f"stride 0 leaves no lookup grid for record_limit {self.record_limit} to pick "
                "from; use a stride >= 1 or record_limit 0"
            )
            raise ConfigError(msg)

    @property
    def min_prefix_tokens(self) -> int:
        """``min_tokens``, resolved."""
        return self.block_size if self.min_tokens is None else self.min_tokens

    @property
    def stride(self) -> int:
        """``stride_tokens``, resolved."""
        return self.block_size if self.stride_tokens is None else self.stride_tokens

    @property
    def effective_stride(self) -> int:
        """The ladder's grid spacing actually used: the stride capped at the min tokens (the
        upstream's rule, spec §2), at least 1. ``--min-tokens 64 --stride 128`` probes every 64."""
        return CandidatePolicy.from_cache_config(kv_cache_config(self)).effective_stride

    @property
    def effective_page_tokens(self) -> int:
        """``page_tokens``, resolved: the stride when unset."""
        return self.stride if self.page_tokens is None else self.page_tokens

    @property
    def grain(self) -> int:
        """The finest prefix the index restores by: the paged index's page size, the ladder's
        grid spacing (:attr:`effective_stride`). The clairvoyant ceiling, in whole blocks,
        exists only when this is the block size."""
        if self.index is CacheIndex.PAGED:
            return self.effective_page_tokens
        return self.effective_stride

    def check_requests(self, requests: Sequence[SimRequest]) -> None:
        """:func:`validate_requests` with this configuration's block size, context and
        concurrency: whether a replay of it can take every request.

        Raises:
            ConfigError: naming the first request it cannot take, and why.
        """
        validate_requests(
            requests,
            block_size=self.block_size,
            max_input_length=self.ctx_size,
            concurrency=self.concurrency,
        )

    def check_capacity(self, capacity_tokens: int) -> None:
        """Refuse a capacity that is not an integer >= 0 (0: unbounded) or whose byte bound no
        cache can hold.

        Raises:
            ConfigError: naming the capacity (and the bytes it comes to).
        """
        check_int("capacity_tokens", capacity_tokens, low=0)
        if capacity_tokens * self.bytes_per_token > MAX_CACHE_BYTES:
            msg = (
                f"capacity_tokens {capacity_tokens:,} x bytes_per_token {self.bytes_per_token:,} "
                f"must be <= {MAX_CACHE_BYTES:,} bytes, got "
                f"{capacity_tokens * self.bytes_per_token:,}"
            )
            raise ConfigError(msg)

    def max_bytes(self, capacity_tokens: int | None = None) -> int:
        """Per-stage byte bound for a capacity in tokens (this config's when None).

        Raises:
            ConfigError: ``capacity_tokens`` is refused by :meth:`check_capacity`.
        """
        if capacity_tokens is None:
            return self.capacity_tokens * self.bytes_per_token
        self.check_capacity(capacity_tokens)
        return capacity_tokens * self.bytes_per_token

    def as_dict(self, capacity_tokens: int | None = None) -> dict[str, object]:
        """The configuration as JSON-ready values (resolved defaults included)."""
        capacity = self.capacity_tokens if capacity_tokens is None else capacity_tokens
        return {
            "stages": self.stages,
            "block_size": self.block_size,
            "min_tokens": self.min_prefix_tokens,
            "stride_tokens": self.stride,
            "effective_stride_tokens": self.effective_stride,
            "record_limit": self.record_limit,
            "max_entries": self.max_entries,
            "capacity_tokens": capacity,
            "max_bytes": self.max_bytes(capacity),
            "bytes_per_token": self.bytes_per_token,
            "concurrency": self.concurrency,
            "prefill_s_per_token": list(self.cost.stage_prefill_s_per_token)
            or self.cost.prefill_s_per_token,
            "restore_s_per_byte": self.cost.restore_s_per_byte,
            "layers_per_stage": self.layers_per_stage,
            "ctx_size": self.ctx_size,
            "model_id": self.model_id,
            "index": str(self.index),
            "page_tokens": self.effective_page_tokens,
            "page_eviction": self.page_eviction,
        }


def kv_cache_config(config: SimConfig, *, capacity_tokens: int | None = None) -> KvCacheConfig:
    """The cache configuration every simulated stage gets.

    This is the one place that turns simulation settings into cache settings, including the
    index (ladder or paged).

    Args:
        config: The simulation settings.
        capacity_tokens: Overrides ``config.capacity_tokens`` (a sweep point).

    Returns:
        A ``lookup-record`` cache with the config's bounds and ladder.

    Raises:
        ConfigError: ``capacity_tokens`` is not an integer >= 0 or its byte bound passes
            :data:`MAX_CACHE_BYTES` (see :meth:`SimConfig.check_capacity`).
    """
    return KvCacheConfig(
        mode=CacheMode.LOOKUP_RECORD,
        payload=CachePayload.RESIDENT_KV,
        max_entries=config.max_entries,
        max_bytes=config.max_bytes(capacity_tokens),
        min_tokens=config.min_prefix_tokens,
        shared_prefix_stride_tokens=config.stride,
        shared_prefix_record_limit=config.record_limit,
        index=config.index,
        page_tokens=config.page_tokens,
        page_eviction=config.page_eviction,
    )


def stage_configs(config: SimConfig, *, capacity_tokens: int | None = None) -> list[StageConfig]:
    """The simulated pipeline's stages: ``config.stages`` contiguous layer ranges, one cache each.

    Args:
        config: The simulation settings.
        capacity_tokens: Overrides ``config.capacity_tokens``.

    Returns:
        The stage configurations in pipeline order.
    """
    cache = kv_cache_config(config, capacity_tokens=capacity_tokens)
    ids = [f"stage-{index}" for index in range(config.stages)]
    per = config.layers_per_stage
    return [
        StageConfig(
            stage_id=stage_id,
            stage_index=index,
            model_id=config.model_id,
            run_id="sim",
            topology_id="sim",
            layer_start=index * per,
            layer_end=(index + 1) * per,
            ctx_size=config.ctx_size,
            kv_cache=cache,
            upstream=ids[index - 1] if index else None,
            downstream=ids[index + 1] if index + 1 < len(ids) else None,
        )
        for index, stage_id in enumerate(ids)
    ]


@attrs.frozen(kw_only=True)
class StageSummary:
    """What one stage did over the whole replay."""

    stage_id: str
    restored_tokens: int
    """Tokens restored from this stage's cache."""
    computed_tokens: int
    """Tokens this stage computed."""
    hits: int
    """Requests that restored at least one token here."""
    records: int
    """Records made: ladder entries (one per rung); in paged mode, record calls that stored
    something (one per prompt)."""
    evictions: int
    """Entries evicted to make room: ladder entries, or pages in paged mode (so a paged run
    can show more evictions than records)."""
    evicted_bytes: int
    """Bytes those evictions freed."""
    resident_bytes_max: int
    """Most bytes resident in this stage's cache at any time."""
    accounting: CacheAccounting | None = None
    """The cache's accounting at the end of the replay: misses by reason, resident vs
    unique-prefix bytes (None when the stage has no cache)."""

    @property
    def token_hit_ratio(self) -> float:
        """Restored share of this stage's prompt tokens."""
        total = self.restored_tokens + self.computed_tokens
        return self.restored_tokens / total if total else 0.0


@attrs.frozen(kw_only=True)
class RequestOutcome:
    """One request's result."""

    index: int
    """Position in the workload."""
    input_length: int
    """Prompt tokens."""
    restored_tokens: tuple[int, ...]
    """Tokens restored, per stage."""
    ttft_cached_s: float
    """Time to first token with the cache (virtual seconds, from arrival)."""
    ttft_uncached_s: float
    """Time to first token without a cache, same arrivals (virtual seconds)."""


@attrs.frozen(kw_only=True)
class OfferedLoad:
    """The busiest stage's work per request times the arrival rate, with and without the cache.

    Above 1, that stage cannot keep up with the arrivals on average: requests queue, and the
    longer the trace runs, the more of each time to first token is waiting.
    """

    cached: float
    """With the cache: each stage's computed tokens and restored bytes at its costs."""
    uncached: float
    """Without it: every prompt token computed at every stage."""


@attrs.frozen(kw_only=True)
class ReplayResult:
    """Everything a report shows about one replay."""

    config: SimConfig
    capacity_tokens: int
    """The capacity this run used (a sweep point, or ``config.capacity_tokens``)."""
    requests: int
    prompt_tokens: int
    restored_tokens: int
    """Tokens restored at stage 0."""
    theoretical: TheoreticalMax
    stages: tuple[StageSummary, ...]
    clairvoyant: ClairvoyantResult | None = attrs.field(default=None, kw_only=True)
    """What a clairvoyant (Belady) cache of this capacity would restore, with pages of the block
    size (:mod:`stage_runtime.sim.clairvoyant`); None when the index's grain
    (:attr:`SimConfig.grain`: the paged index's page size, or the ladder's grid spacing) is not
    the block size: a finer one can restore part of a block, which a ceiling in whole blocks
    would not count."""
    ttft_cached: Percentiles
    ttft_uncached: Percentiles
    wall_s: float
    """Real seconds the replay took (pipeline start to stop)."""
    virtual_s: float
    """Virtual seconds from the first arrival to the last finish."""
    outcomes: tuple[RequestOutcome, ...] = attrs.field(repr=False)
    arrival_span_s: float = 0.0
    """Seconds from the first arrival to the last (the trace's timestamps or the workload's
    arrivals; they pace the replay only when ``config.concurrency > 1``)."""

    @property
    def offered_load(self) -> OfferedLoad | None:
        """How loaded the busiest stage was by the arrivals, or None when arrivals did not pace
        the replay (concurrency 1: one request after another) or all came at once (no arrival
        rate to load the stages with; :attr:`waiting_share` still says how long they queued).

        The arrival rate is estimated as ``(requests - 1) / arrival_span_s`` (the span holds one
        gap fewer than requests), so the load is the busiest stage's work per request times
        that rate.
        """
        if self.config.concurrency == 1 or self.arrival_span_s <= 0 or self.requests < 2:
            return None
        cached = max(self._stage_work_s())
        cost = self.config.cost
        uncached = max(
            cost.uncached_stage_cost(self.prompt_tokens, index) for index in range(len(self.stages))
        )
        per_second = (self.requests - 1) / self.requests / self.arrival_span_s
        load = OfferedLoad(cached=cached * per_second, uncached=uncached * per_second)
        if not (math.isfinite(load.cached) and math.isfinite(load.uncached)):
            return None  # arrivals too close together (1e-320 s apart) to say anything
        return load

    @property
    def waiting_share(self) -> float | None:
        """Share of the time to first token with the cache, over all requests, spent waiting
        (for a busy stage or an admission slot) rather than computing and restoring.

        None only when arrivals did not pace the replay (concurrency 1: one request after
        another, nothing waits) or no time passed at all (every cost 0). Requests that all
        arrive at once do have a share, unlike :attr:`offered_load`: they queue behind one
        another, as in any burst.
        """
        if self.config.concurrency == 1:
            return None
        total = sum(outcome.ttft_cached_s for outcome in self.outcomes)
        if total <= 0:
            return None
        # Costs are linear, so the stages' totals add up to every request's own work.
        working = sum(self._stage_work_s())
        return min(max(1 - working / total, 0.0), 1.0)

    def _stage_work_s(self) -> list[float]:
        """Seconds each stage spent computing and restoring over the replay (with the cache)."""
        cost, bytes_per_token = self.config.cost, self.config.bytes_per_token
        return [
            cost.stage_cost(
                computed_tokens=stage.computed_tokens,
                restored_bytes=stage.restored_tokens * bytes_per_token,
                stage_index=index,
            )
            for index, stage in enumerate(self.stages)
        ]

    @property
    def token_hit_ratio(self) -> float:
        """Stage 0's restored share of all prompt tokens."""
        return self.restored_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    @property
    def tokens_per_s(self) -> float:
        """Prompt tokens replayed per real second."""
        return self.prompt_tokens / self.wall_s if self.wall_s > 0 else 0.0


@attrs.frozen(kw_only=True)
class StageReplay:
    """What one stage did over a whole replay, request by request.

    It is all :func:`summarise_replay` needs of a stage: a one-process replay gathers one per
    stage from its pipeline's reports, a fanned-out one gets one from each unit
    (:func:`~stage_runtime.sim.fanout.replay_stage`), and both are summarised by the same code.
    """

    stage_id: str
    """The stage's id."""
    restored_tokens: tuple[int, ...]
    """Tokens the stage restored for each request, in admission order (:func:`admission_order`)."""
    computed_tokens: tuple[int, ...]
    """Tokens the stage computed for each request, in admission order."""
    records: int
    """Records made (see :attr:`StageSummary.records`)."""
    evictions: int
    """Entries evicted to make room (see :attr:`StageSummary.evictions`)."""
    evicted_bytes: int
    """Bytes those evictions freed."""
    resident_bytes_max: int
    """Most bytes resident in the stage's cache at any time."""
    accounting: CacheAccounting | None = None
    """The cache's accounting at the end (None when the stage has no cache)."""


class _StageTally:
    """One stage's figures while a replay runs (a plain slotted class: it is updated for every
    request, and the reports it reads are valid already)."""

    __slots__ = ("computed", "evicted_bytes", "evictions", "records", "resident_max", "restored")

    def __init__(self, requests: int) -> None:
        self.restored = [0] * requests
        self.computed = [0] * requests
        self.records = 0
        self.evictions = 0
        self.evicted_bytes = 0
        self.resident_max = 0

    def add(self, position: int, report: StagePrefillReport) -> None:
        """Count the stage's report on the request at ``position`` in admission order. The
        report is dropped afterwards (with its records and evicted entries), so a long replay
        holds no more than a few numbers per request."""
        self.restored[position] = report.restored_tokens
        self.computed[position] = report.computed_tokens
        for record in report.records:
            if record.payload_bytes:  # (a paged prompt whose pages were all cached: none)
                self.records += 1
            if record.resident_bytes > self.resident_max:
                self.resident_max = record.resident_bytes
            self.evictions += record.evicted_entries
            self.evicted_bytes += record.evicted_bytes

    def replay(self, stage_id: str, accounting: CacheAccounting | None) -> StageReplay:
        """The stage's figures, once every request has been counted."""
        return StageReplay(
            stage_id=stage_id,
            restored_tokens=tuple(self.restored),
            computed_tokens=tuple(self.computed),
            records=self.records,
            evictions=self.evictions,
            evicted_bytes=self.evicted_bytes,
            resident_bytes_max=self.resident_max,
            accounting=accounting,
        )


def admission_order(requests: Sequence[SimRequest], concurrency: int) -> list[SimRequest]:
    """The order in which a replay admits requests into stage 0, and so into every stage.

    Each stage serves its requests one at a time in that order, so it alone decides every hit:
    timing never does.

    Args:
        requests: The workload, in file order.
        concurrency: Requests in flight (``SimConfig.concurrency``).

    Returns:
        File order at concurrency 1; otherwise by arrival, ties in file order (``(arrival_s,
        index)``).

    Raises:
        ConfigError: ``concurrency`` is not an integer >= 1.
    """
    check_int("concurrency", concurrency, low=1)
    if concurrency == 1:
        return list(requests)
    return sorted(requests, key=lambda request: (request.arrival_s, request.index))


def validate_requests(
    requests: Sequence[SimRequest],
    *,
    block_size: int,
    max_input_length: int | None = None,
    concurrency: int = 1,
) -> None:
    """Check that every request can be turned into a prompt, before any replay starts.

    Args:
        requests: The workload.
        block_size: Tokens per block id (an integer in ``[4, 1,048,576]``).
        max_input_length: The longest prompt the stages take (their ``ctx_size``); None: no
            limit.
        concurrency: The replay's ``SimConfig.concurrency``: above 1 arrivals pace it, and
            their span is bounded; at 1 timestamps are not used, and any finite ones do.

    Raises:
        ConfigError: ``block_size``, ``max_input_length`` or ``concurrency`` is out of range;
            or, naming the request: an empty prompt, a prompt longer than
            ``max_input_length``, more tokens than its blocks hold,
            block lengths that do not add up, an arrival time that is not a finite number,
            two requests with the same index; or, at ``concurrency`` above 1, arrivals
            spanning more than :data:`MAX_ARRIVAL_SPAN_S`.
    """
    check_block_size(block_size)
    if max_input_length is not None:
        check_int("max_input_length", max_input_length, low=1)
    check_int("concurrency", concurrency, low=1)
    seen: set[int] = set()
    for position, request in enumerate(requests):
        if not is_int(request.index, numpy=True):
            index = shown(request.index)
            msg = f"request at position {position}: index must be an integer, got {index}"
            raise ConfigError(msg)
        where = f"request {request.index}"
        if request.index in seen:
            msg = f"{where}: index must be unique, got {request.index} twice"
            raise ConfigError(msg)
        seen.add(request.index)
        _check_request_types(request, where)
        if request.input_length < 1:
            msg = f"{where}: input_length must be >= 1, got {request.input_length}"
            raise ConfigError(msg)
        if max_input_length is not None and request.input_length > max_input_length:
            # The pipeline would refuse it only when its turn came, part-way through the replay.
            msg = (
                f"{where}: input_length must be <= {max_input_length:,} (the stages' "
                f"ctx_size), got {request.input_length:,}"
            )
            raise ConfigError(msg)
        arrival = request.arrival_s
        if (
            isinstance(arrival, bool)
            or not isinstance(arrival, numbers.Real)
            or not math.isfinite(arrival)
        ):
            # an infinite arrival would never come: a replay at concurrency > 1 waited forever
            msg = f"{where}: arrival_s must be a finite number, got {arrival!r}"
            raise ConfigError(msg)
        lengths = request.block_lengths
        if lengths is None:
            capacity = block_size * len(request.block_ids)
            if request.input_length > capacity:
                msg = (
                    f"{where}: input_length must be <= block_size * len(block_ids) = "
                    f"{capacity}, got {request.input_length}"
                )
                raise ConfigError(msg)
        elif (
            len(lengths) != len(request.block_ids)
            or any(not 0 <= length <= block_size for length in lengths)
            or sum(lengths) != request.input_length
        ):
            msg = (
                f"{where}: block_lengths must give one length in [0, {block_size}] per block "
                f"and sum to input_length {request.input_length}, got {list(lengths)}"
            )
            raise ConfigError(msg)
    if requests and concurrency > 1:
        arrivals = [float(request.arrival_s) for request in requests]
        first, last = arrivals.index(min(arrivals)), arrivals.index(max(arrivals))
        span = arrivals[last] - arrivals[first]
        if span > MAX_ARRIVAL_SPAN_S:
            # Virtual time counts from the first arrival; this far from it a float clock
            # cannot tell microseconds apart, and stage costs would round away. One request
            # at a time, arrivals are not used: the replay takes them in file order.
            msg = (
                f"arrivals must span at most {MAX_ARRIVAL_SPAN_S:.0e} s (about 31 years) at "
                f"concurrency > 1, got {span:.3g} s, from {_named(requests[first])} to "
                f"{_named(requests[last])}"
            )
            raise ConfigError(msg)


def _named(request: SimRequest) -> str:
    """``request 3 (line 4)``: a request as an error names it (its trace line when read from
    one)."""
    return f"request {request.index}" + (f" (line {request.line})" if request.line else "")


_INT_TYPE: Final = {int}


def _check_request_types(request: SimRequest, where: str) -> None:
    """Refuse a request whose length, block ids or block lengths are not integers (a
    hand-built :class:`SimRequest` is not checked when it is made): the tokenizer would
    otherwise fail on it, or truncate a float, only when its turn came in the replay."""
    if not is_int(request.input_length, numpy=True):
        msg = f"{where}: input_length must be an integer, got {shown(request.input_length)}"
        raise ConfigError(msg)
    for field in ("block_ids", "block_lengths"):
        values = getattr(request, field)
        if values is None and field == "block_lengths":
            continue
        if type(values) is tuple and (not values or set(map(type, values)) == _INT_TYPE):
            continue  # the usual case (a trace line, a synthetic workload), decided at once
        if not isinstance(values, tuple | list | np.ndarray) or getattr(values, "ndim", 1) != 1:
            msg = f"{where}: {field} must be a sequence of integers, got {shown(values)}"
            raise ConfigError(msg)
        for index, value in enumerate(values):
            if not is_int(value, numpy=True):
                msg = f"{where}: {field} must hold integers, got {shown(value)} at position {index}"
                raise ConfigError(msg)


async def _prefill(
    pipeline: Pipeline, request: SimRequest, tokens: npt.NDArray[np.int32]
) -> PrefillResult:
    # The prompt is the driver's own (the tokenizer made it for this request): frozen, the
    # pipeline takes it without copying it.
    tokens.flags.writeable = False
    return await pipeline.prefill(
        tokens, session_id=f"session-{request.index}", request_id=f"request-{request.index}"
    )


async def replay(
    requests: Sequence[SimRequest],
    config: SimConfig,
    *,
    capacity_tokens: int | None = None,
    theoretical: TheoreticalMax | None = None,
    progress: ProgressCallback | None = None,
    virtual_time: bool | None = None,
) -> ReplayResult:
    """Replay requests through a pipeline of simulated stages (call inside a trio run).

    The figures come from what each stage did per request (:func:`summarise_replay`); whether
    the stages sleep their costs changes none of them. With ``concurrency > 1`` (or
    ``virtual_time=True``) they do, and arrivals are paced by their timestamps, so the
    pipeline runs on the caller's clock as it would serve them: run it under a virtual clock
    (``trio.testing.MockClock(autojump_threshold=0)``, or the ``autojump_clock`` fixture in
    tests), where that takes no wall time. :func:`run_replay` starts a virtual-time trio run
    for you.

    Args:
        requests: The workload, in file order (admitted by ``arrival_s`` when
            ``config.concurrency > 1``; see :func:`admission_order`).
        config: The simulation settings.
        capacity_tokens: Overrides ``config.capacity_tokens`` (for sweeps).
        theoretical: The workload's theoretical maximum, if already computed.
        progress: Called with the count of finished requests after each one.
        virtual_time: Whether the stages sleep their cost and arrivals are paced. ``None``
            (default): only when ``concurrency > 1``.

    Returns:
        Per-stage and per-request results, TTFT percentiles and the theoretical maximum.

    Raises:
        ConfigError: the requests or the settings are invalid.
    """
    capacity = config.capacity_tokens if capacity_tokens is None else capacity_tokens
    config.check_capacity(capacity)
    config.check_requests(requests)
    if theoretical is None:
        theoretical = theoretical_max_hit_ratio(requests, block_size=config.block_size)
    configs = stage_configs(config, capacity_tokens=capacity)
    sleep = config.concurrency > 1 if virtual_time is None else virtual_time
    factory = simulated_model_factory(
        bytes_per_token=config.bytes_per_token, cost=config.cost, sleep=sleep
    )
    tokenizer = BlockTokenizer(config.block_size)
    ordered = admission_order(requests, config.concurrency)
    if config.grain == config.block_size:
        # The ceiling's plan, made while the caches are still empty (its summary reuses it).
        plan_of(ordered, block_size=config.block_size)
    tallies = [_StageTally(len(ordered)) for _ in configs]
    finished = 0

    def finish(position: int, result: PrefillResult) -> None:
        nonlocal finished
        for tally, report in zip(tallies, result.stages, strict=True):
            tally.add(position, report)
        finished += 1
        if progress is not None:
            progress(finished)

    wall_start = time.perf_counter()
    # Channels as deep as the concurrency: a stage never waits for room downstream, so the
    # stages behave as FIFO queues with unbounded buffers, the model the TTFTs are computed by.
    # environ={}: a simulation is what its SimConfig says. The STAGE_RUNTIME_KV_CACHE* variables
    # (the kill switch, bounds) are for stages serving traffic; read here, they would silently
    # turn a what-if into something else (the kill switch made every replay restore 0%).
    async with open_pipeline(
        configs, factory, channel_size=max(4, config.concurrency), environ={}
    ) as pipeline:
        # Each prompt is made as its request's turn comes (the tokenizer mixes the block ids
        # of a few hundred requests at a time).
        prompts = zip(ordered, tokenizer.each_request_tokens(ordered), strict=True)
        if config.concurrency == 1:
            for position, (request, tokens) in enumerate(prompts):
                finish(position, await _prefill(pipeline, request, tokens))
        else:
            await _replay_concurrently(
                pipeline, prompts, ordered, config.concurrency, finish, paced=sleep
            )
        final = await pipeline.statistics()
    wall_s = time.perf_counter() - wall_start
    stages = [
        tally.replay(stage.stage_id, stage.accounting)
        for tally, stage in zip(tallies, final.stages, strict=True)
    ]
    return summarise_replay(
        requests, config, stages, capacity_tokens=capacity, theoretical=theoretical, wall_s=wall_s
    )


async def _replay_concurrently(
    pipeline: Pipeline,
    prompts: Iterable[tuple[SimRequest, npt.NDArray[np.int32]]],
    ordered: Sequence[SimRequest],
    concurrency: int,
    finish: Callable[[int, PrefillResult], None],
    *,
    paced: bool,
) -> None:
    """Prefill ``ordered`` (in admission order; ``prompts`` pairs each with its tokens) with at
    most ``concurrency`` in flight; when ``paced``, each no earlier than its arrival on the
    run's clock."""
    limiter = trio.CapacityLimiter(concurrency)
    # Virtual time counts from the first arrival: timestamps far from 0 (epoch microseconds,
    # say) would otherwise leave the clock too coarse for the stage costs.
    origin = float(ordered[0].arrival_s) if ordered else 0.0
    start = trio.current_time()

    async def one(
        position: int,
        request: SimRequest,
        tokens: npt.NDArray[np.int32],
        *,
        task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
    ) -> None:
        try:
            task_status.started()
            # From started() to the send into stage 0 there is no checkpoint, so this request
            # is queued there before the feeder admits the next one.
            finish(position, await _prefill(pipeline, request, tokens))
        finally:
            limiter.release_on_behalf_of(request)

    async with trio.open_nursery() as nursery:
        for position, (request, tokens) in enumerate(prompts):
            if paced:
                await trio.sleep_until(start + (float(request.arrival_s) - origin))
            await limiter.acquire_on_behalf_of(request)
            # start, not start_soon: the feeder goes on once this request is queued at stage 0,
            # so requests reach it in admission order by construction, not by how trio happens
            # to schedule the tasks it wakes together (in an order it randomises).
            await nursery.start(one, position, request, tokens)


def _clairvoyant(
    ordered: Sequence[SimRequest], config: SimConfig, capacity_tokens: int
) -> ClairvoyantResult | None:
    """The clairvoyant ceiling of a replay at its capacity, or None when the index's grain
    (:attr:`SimConfig.grain`) differs from the block size (the ceiling's pages are blocks)."""
    if config.grain != config.block_size:
        return None
    workload = plan_of(ordered, block_size=config.block_size)
    return clairvoyant_hits(workload, capacity_pages(capacity_tokens, config.block_size))


def summarise_replay(
    requests: Sequence[SimRequest],
    config: SimConfig,
    stages: Sequence[StageReplay],
    *,
    capacity_tokens: int | None = None,
    theoretical: TheoreticalMax | None = None,
    wall_s: float = 0.0,
) -> ReplayResult:
    """A replay's figures from what each of its stages did, request by request.

    Every time is computed here, once, from the cost model: a stage spends
    ``cost.stage_cost(computed, restored bytes)`` on a request. At concurrency 1 requests run
    one after another, so a time to first token is the sum of its stages' costs; above, they
    pass single-server FIFO stages in admission order from their arrivals
    (:func:`~stage_runtime.sim.cost.pipeline_finish_times`), with the cache's costs and with
    every token computed. A one-process replay and a fanned-out one both end here, which is
    why their results are identical.

    Args:
        requests: The workload, in file order.
        config: The simulation settings.
        stages: One per stage, in pipeline order, each listing requests in admission order.
        capacity_tokens: The capacity replayed (``config.capacity_tokens`` when None).
        theoretical: The workload's theoretical maximum (computed when None).
        wall_s: Real seconds the replay took.

    Returns:
        The replay's result.

    Raises:
        ConfigError: ``stages`` does not hold one entry per stage, or one per request each, or
            ``capacity_tokens`` is refused by :meth:`SimConfig.check_capacity`.
    """
    capacity = config.capacity_tokens if capacity_tokens is None else capacity_tokens
    config.check_capacity(capacity)
    if theoretical is None:
        theoretical = theoretical_max_hit_ratio(requests, block_size=config.block_size)
    ordered = admission_order(requests, config.concurrency)
    count = len(ordered)
    if len(stages) != config.stages or any(
        len(stage.restored_tokens) != count or len(stage.computed_tokens) != count
        for stage in stages
    ):
        msg = (
            f"stages must hold {config.stages} stage replays of {count} requests each, got "
            f"{[len(stage.restored_tokens) for stage in stages]}"
        )
        raise ConfigError(msg)
    cost, bytes_per_token = config.cost, config.bytes_per_token
    cached_costs = [
        [
            cost.stage_cost(
                computed_tokens=stage.computed_tokens[position],
                restored_bytes=stage.restored_tokens[position] * bytes_per_token,
                stage_index=index,
            )
            for index, stage in enumerate(stages)
        ]
        for position in range(count)
    ]
    uncached_costs = [
        [cost.uncached_stage_cost(request.input_length, index) for index in range(len(stages))]
        for request in ordered
    ]
    if config.concurrency == 1:
        # One at a time: each request starts when the previous one finished.
        cached = [sum(costs) for costs in cached_costs]
        uncached = [sum(costs) for costs in uncached_costs]
        virtual_s = sum(cached)
    else:
        # From the first arrival, as the replay's clock counts.
        origin = float(ordered[0].arrival_s) if ordered else 0.0
        arrivals = [float(request.arrival_s) - origin for request in ordered]
        concurrency = config.concurrency
        finishes = pipeline_finish_times(arrivals, cached_costs, concurrency=concurrency)
        cached = [finish - arrival for finish, arrival in zip(finishes, arrivals, strict=True)]
        without = pipeline_finish_times(arrivals, uncached_costs, concurrency=concurrency)
        uncached = [finish - arrival for finish, arrival in zip(without, arrivals, strict=True)]
        virtual_s = max(finishes, default=0.0)

    # Each request's restored tokens per stage, zipped at once (not a generator per request;
    # there is at least one stage, and each has every request, as checked above).
    restored = zip(*(stage.restored_tokens for stage in stages), strict=True)
    outcomes = sorted(
        (
            RequestOutcome(
                index=request.index,
                input_length=request.input_length,
                restored_tokens=by_stage,
                ttft_cached_s=cached[position],
                ttft_uncached_s=uncached[position],
            )
            for position, (request, by_stage) in enumerate(zip(ordered, restored, strict=True))
        ),
        key=lambda outcome: outcome.index,
    )
    summaries = tuple(
        StageSummary(
            stage_id=stage.stage_id,
            restored_tokens=sum(stage.restored_tokens),
            computed_tokens=sum(stage.computed_tokens),
            hits=sum(1 for restored in stage.restored_tokens if restored > 0),
            records=stage.records,
            evictions=stage.evictions,
            evicted_bytes=stage.evicted_bytes,
            resident_bytes_max=stage.resident_bytes_max,
            accounting=stage.accounting,
        )
        for stage in stages
    )
    return ReplayResult(
        config=config,
        capacity_tokens=capacity,
        requests=len(requests),
        prompt_tokens=sum(request.input_length for request in requests),
        restored_tokens=summaries[0].restored_tokens if summaries else 0,
        theoretical=theoretical,
        stages=summaries,
        clairvoyant=_clairvoyant(ordered, config, capacity),
        ttft_cached=percentiles([o.ttft_cached_s for o in outcomes]),
        ttft_uncached=percentiles([o.ttft_uncached_s for o in outcomes]),
        wall_s=wall_s,
        virtual_s=virtual_s,
        outcomes=tuple(outcomes),
        arrival_span_s=(
            float(max(r.arrival_s for r in requests) - min(r.arrival_s for r in requests))
            if requests
            else 0.0
        ),
    )
