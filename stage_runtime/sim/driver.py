"""Replay a workload through a real pipeline of simulated stages, in virtual time.

The requests go through :func:`~stage_runtime.pipeline.open_pipeline` exactly as a server's
would: every stage restores, computes (a :class:`~stage_runtime.sim.model.SimulatedStageModel`
that sleeps its cost), records with the ladder, and forwards. Payloads are virtual and time is
virtual, so a 61-million-token trace replays in seconds and fits in memory.

- ``concurrency == 1``: requests in workload (file) order, each finishing at every stage before
  the next starts. Nothing overlaps, so a request's time to first token is the sum of its
  stages' costs; the models skip their sleeps and the driver adds the costs up (the same
  number the virtual clock would show, about 15% less wall time; ``virtual_time=True`` sleeps
  anyway).
- ``concurrency > 1``: requests arrive at their timestamps in virtual time, with at most
  ``concurrency`` in flight (later arrivals wait for a slot, in arrival order).
"""

from __future__ import annotations

import math
import numbers
import time
from collections.abc import Callable, Sequence
from typing import Any, Final

import attrs
import numpy as np
import numpy.typing as npt
import trio
import trio.testing

from stage_runtime.accounting import CacheAccounting
from stage_runtime.config import CacheIndex, CacheMode, CachePayload, KvCacheConfig, StageConfig
from stage_runtime.errors import ConfigError
from stage_runtime.pipeline import Pipeline, PrefillResult, open_pipeline
from stage_runtime.policy import CandidatePolicy
from stage_runtime.sim.blocks import BlockTokenizer
from stage_runtime.sim.cost import CostModel, Percentiles, percentiles, pipeline_finish_times
from stage_runtime.sim.model import simulated_model_factory
from stage_runtime.sim.theory import TheoreticalMax, theoretical_max_hit_ratio
from stage_runtime.sim.trace import SimRequest

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
    "SimConfig",
    "StageSummary",
    "kv_cache_config",
    "replay",
    "run_replay",
    "run_sweep",
    "stage_configs",
    "validate_requests",
]

MIN_BLOCK_SIZE = 4
"""Smallest ``block_size``: blocks of fewer tokens cannot keep every two hash ids apart (see
:class:`~stage_runtime.sim.blocks.BlockTokenizer`), so the replay would share prefixes the
trace does not."""

MAX_STAGES = 256
"""Most pipeline stages in a simulation (each is a trio task with its own cache actor)."""

MAX_BLOCK_SIZE = 1 << 20
"""Largest ``block_size``: a million tokens per hash id (the Mooncake traces use 512). Token
blocks are generated at this size, so an absurd value would exhaust memory, not fail."""

MAX_BYTES_PER_TOKEN = 1 << 24
"""Largest ``bytes_per_token``: 16 MiB, an 8-million-wide bf16 activation (a 4,096-wide model
needs 8,192). Frames must keep their width within int32."""

MAX_CACHE_BYTES = 2**64 - 1
"""Largest per-stage byte bound (``capacity_tokens * bytes_per_token``) a cache accepts."""

MAX_ARRIVAL_SPAN_S = 1e9
"""Longest span of arrival times a replay accepts (seconds, about 31 years): the virtual clock
counts from the first arrival in floating point, which still resolves microseconds there."""

ProgressCallback = Callable[[int], None]
"""Called with the number of finished requests after each one finishes."""


def _at_least(minimum: int) -> Callable[[object, attrs.Attribute[Any], Any], None]:
    def check(instance: object, attribute: attrs.Attribute[Any], value: Any) -> None:
        if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
            name = attribute.alias or attribute.name  # the keyword the caller used
            msg = f"{name} must be an integer >= {minimum}, got {value!r}"
            raise ConfigError(msg)

    return check


def _between(minimum: int, maximum: int) -> Callable[[object, attrs.Attribute[Any], Any], None]:
    check = _at_least(minimum)

    def between(instance: object, attribute: attrs.Attribute[Any], value: Any) -> None:
        check(instance, attribute, value)
        if value > maximum:
            msg = f"{attribute.name} must be <= {maximum:,}, got {value:,}"
            raise ConfigError(msg)

    return between


def _optional_at_least(minimum: int) -> Callable[[object, attrs.Attribute[Any], Any], None]:
    check = _at_least(minimum)

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


def _eviction(instance: object, attribute: attrs.Attribute[Any], value: object) -> None:
    if value not in ("lru", "reuse"):
        msg = f"page_eviction must be 'lru' or 'reuse', got {value!r}"
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

    record_limit: int = attrs.field(default=2, validator=_at_least(0))
    """Prefix lengths one record stores (``0``: every grid length)."""

    capacity_tokens: int = attrs.field(default=0, validator=_at_least(0))
    """Per-stage cache capacity in tokens (``max_bytes = capacity * bytes_per_token``; 0: none)."""

    bytes_per_token: int = attrs.field(default=8192, validator=_between(1, MAX_BYTES_PER_TOKEN))
    """Activation bytes per token (8,192: a 4,096-wide bf16 activation)."""

    concurrency: int = attrs.field(default=1, validator=_at_least(1))
    """Requests in flight at once (1: file order, one at a time)."""

    cost: CostModel = attrs.field(factory=CostModel)
    """Virtual-time costs."""

    layers_per_stage: int = attrs.field(default=8, validator=_at_least(1))
    """Layers each simulated stage holds (identity only)."""

    ctx_size: int = attrs.field(default=262_144, validator=_at_least(1))
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
    """Tokens per page in paged mode; ``None``: the stride."""

    page_eviction: str = attrs.field(default="lru", validator=_eviction)
    """Paged mode's eviction: ``lru`` or ``reuse``."""

    def __attrs_post_init__(self) -> None:
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

    def check_capacity(self, capacity_tokens: int) -> None:
        """Refuse a capacity that is negative or whose byte bound no cache can hold.

        Raises:
            ConfigError: naming the capacity and the bytes it comes to.
        """
        if capacity_tokens < 0:
            msg = f"capacity_tokens must be >= 0, got {capacity_tokens}"
            raise ConfigError(msg)
        if capacity_tokens * self.bytes_per_token > MAX_CACHE_BYTES:
            msg = (
                f"capacity_tokens {capacity_tokens:,} x bytes_per_token {self.bytes_per_token:,} "
                f"must be <= {MAX_CACHE_BYTES:,} bytes, got "
                f"{capacity_tokens * self.bytes_per_token:,}"
            )
            raise ConfigError(msg)

    def max_bytes(self, capacity_tokens: int | None = None) -> int:
        """Per-stage byte bound for a capacity in tokens (this config's when None)."""
        capacity = self.capacity_tokens if capacity_tokens is None else capacity_tokens
        return capacity * self.bytes_per_token

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
    """
    if capacity_tokens is not None:
        config.check_capacity(capacity_tokens)
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
        the replay (concurrency 1: one request after another) or all came at once.

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
        (for a busy stage or an admission slot) rather than computing and restoring; None when
        arrivals did not pace the replay (concurrency 1: nothing waits)."""
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


@attrs.define(eq=False)
class _Collector:
    """Per-request bookkeeping during one replay (written by one task at a time)."""

    stage_ids: list[str]
    outcomes: dict[int, _Finished] = attrs.field(factory=dict)
    """What the summary needs of each request; the results themselves (frames, records, the
    entries each record evicted) are dropped as they arrive, so a long replay holds no more
    than a few numbers per request (and the garbage collector has no growing heap to walk)."""
    evictions: list[int] = attrs.field(init=False)
    evicted_bytes: list[int] = attrs.field(init=False)
    records: list[int] = attrs.field(init=False)
    resident_max: list[int] = attrs.field(init=False)
    done: int = 0
    progress: ProgressCallback | None = None

    def __attrs_post_init__(self) -> None:
        count = len(self.stage_ids)
        self.evictions = [0] * count
        self.evicted_bytes = [0] * count
        self.records = [0] * count
        self.resident_max = [0] * count

    def finish(
        self, request: SimRequest, result: PrefillResult, started_s: float, finished_s: float
    ) -> None:
        reports = result.stages
        for position, report in enumerate(reports):
            for record in report.records:
                if record.payload_bytes:  # (a paged prompt whose pages were all cached: none)
                    self.records[position] += 1
                if record.resident_bytes > self.resident_max[position]:
                    self.resident_max[position] = record.resident_bytes
                self.evictions[position] += record.evicted_entries
                self.evicted_bytes[position] += record.evicted_bytes
        self.outcomes[request.index] = _Finished(
            started_s=started_s,
            finished_s=finished_s,
            restored=tuple(report.restored_tokens for report in reports),
            computed=tuple(report.computed_tokens for report in reports),
        )
        self.done += 1
        if self.progress is not None:
            self.progress(self.done)


@attrs.frozen
class _Finished:
    """One replayed request, as the summary needs it."""

    started_s: float
    finished_s: float
    restored: tuple[int, ...]
    """Tokens each stage restored."""
    computed: tuple[int, ...]
    """Tokens each stage computed."""


def validate_requests(requests: Sequence[SimRequest], *, block_size: int) -> None:
    """Check that every request can be turned into a prompt, before any replay starts.

    Raises:
        ConfigError: naming the request: an empty prompt, more tokens than its blocks hold,
            block lengths that do not add up, an arrival time that is not a finite number,
            arrivals spanning more than :data:`MAX_ARRIVAL_SPAN_S`, or two requests with the
            same index.
    """
    seen: set[int] = set()
    for request in requests:
        where = f"request {request.index}"
        if request.index in seen:
            msg = f"{where}: index must be unique, got {request.index} twice"
            raise ConfigError(msg)
        seen.add(request.index)
        if request.input_length < 1:
            msg = f"{where}: input_length must be >= 1, got {request.input_length}"
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
    if requests:
        arrivals = [float(request.arrival_s) for request in requests]
        span = max(arrivals) - min(arrivals)
        if span > MAX_ARRIVAL_SPAN_S:
            # Virtual time counts from the first arrival; this far from it a float clock
            # cannot tell microseconds apart, and stage costs would round away.
            msg = (
                f"arrivals must span at most {MAX_ARRIVAL_SPAN_S:.0e} s (about 31 years), "
                f"got {span:.3g} s"
            )
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


async def _prefill(
    pipeline: Pipeline, tokenizer: BlockTokenizer, request: SimRequest
) -> PrefillResult:
    tokens: npt.NDArray[np.int32] = tokenizer.request_tokens(request)
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

    With ``concurrency > 1`` (or ``virtual_time=True``) the stages sleep their simulated cost,
    so run it under a virtual clock (``trio.testing.MockClock(autojump_threshold=0)``, or the
    ``autojump_clock`` fixture in tests); under a real clock it works too, but takes the
    simulated time for real. :func:`run_replay` starts a virtual-time trio run for you.

    Args:
        requests: The workload, in file order (arrival order is by ``arrival_s`` when
            ``config.concurrency > 1``).
        config: The simulation settings.
        capacity_tokens: Overrides ``config.capacity_tokens`` (for sweeps).
        theoretical: The workload's theoretical maximum, if already computed.
        progress: Called with the count of finished requests after each one.
        virtual_time: Whether the stages sleep their cost. ``None`` (default): only when
            ``concurrency > 1``; one request at a time, TTFT is the sum of stage costs.
            ``False`` needs ``concurrency == 1`` (queueing is made of the sleeps).

    Returns:
        Per-stage and per-request results, TTFT percentiles and the theoretical maximum.

    Raises:
        ConfigError: the requests or the settings are invalid, or ``virtual_time=False`` with
            ``concurrency > 1``.
    """
    if virtual_time is False and config.concurrency > 1:
        # Requests queue only because the stages sleep their costs: without the sleeps every
        # request would seem to run alone, and TTFTs with the cache would be wrong.
        msg = f"virtual_time=False needs concurrency 1, got concurrency {config.concurrency}"
        raise ConfigError(msg)
    capacity = config.capacity_tokens if capacity_tokens is None else capacity_tokens
    validate_requests(requests, block_size=config.block_size)
    if theoretical is None:
        theoretical = theoretical_max_hit_ratio(requests, block_size=config.block_size)
    configs = stage_configs(config, capacity_tokens=capacity)
    sleep = config.concurrency > 1 if virtual_time is None else virtual_time
    factory = simulated_model_factory(
        bytes_per_token=config.bytes_per_token, cost=config.cost, sleep=sleep
    )
    tokenizer = BlockTokenizer(config.block_size)
    collector = _Collector([c.stage_id for c in configs], progress=progress)

    wall_start = time.perf_counter()
    # Channels as deep as the concurrency: a stage never waits for room downstream, so the
    # stages behave as FIFO queues with unbounded buffers, the model the uncached TTFT uses.
    # environ={}: a simulation is what its SimConfig says. The STAGE_RUNTIME_KV_CACHE* variables
    # (the kill switch, bounds) are for stages serving traffic; read here, they would silently
    # turn a what-if into something else (the kill switch made every replay restore 0%).
    async with open_pipeline(
        configs, factory, channel_size=max(4, config.concurrency), environ={}
    ) as pipeline:
        clock_start = trio.current_time()
        if config.concurrency == 1:
            for request in requests:
                started = trio.current_time()
                result = await _prefill(pipeline, tokenizer, request)
                collector.finish(
                    request, result, started - clock_start, trio.current_time() - clock_start
                )
        else:
            await _replay_concurrently(pipeline, tokenizer, requests, config, collector)
        final = await pipeline.stats()
    wall_s = time.perf_counter() - wall_start
    accounting = tuple(stage.accounting for stage in final.stages)
    return _summarise(
        config, capacity, requests, collector, theoretical, wall_s, accounting, slept=sleep
    )


async def _replay_concurrently(
    pipeline: Pipeline,
    tokenizer: BlockTokenizer,
    requests: Sequence[SimRequest],
    config: SimConfig,
    collector: _Collector,
) -> None:
    limiter = trio.CapacityLimiter(config.concurrency)
    ordered = sorted(requests, key=lambda r: (r.arrival_s, r.index))
    # Virtual time counts from the first arrival: timestamps far from 0 (epoch microseconds,
    # say) would otherwise leave the clock too coarse for the stage costs, which rounding then
    # shortens or drops (TTFTs of 0).
    origin = ordered[0].arrival_s if ordered else 0.0
    start = trio.current_time()

    async def one(request: SimRequest, arrived: float) -> None:
        try:
            result = await _prefill(pipeline, tokenizer, request)
            collector.finish(request, result, arrived, trio.current_time() - start)
        finally:
            limiter.release_on_behalf_of(request)

    async with trio.open_nursery() as nursery:
        for request in ordered:
            arrived = request.arrival_s - origin
            await trio.sleep_until(start + arrived)
            await limiter.acquire_on_behalf_of(request)
            nursery.start_soon(one, request, arrived)


def _summarise(
    config: SimConfig,
    capacity: int,
    requests: Sequence[SimRequest],
    collector: _Collector,
    theoretical: TheoreticalMax,
    wall_s: float,
    accounting: Sequence[CacheAccounting | None],
    *,
    slept: bool,
) -> ReplayResult:
    stage_count = config.stages
    restored = [0] * stage_count
    computed = [0] * stage_count
    hits = [0] * stage_count
    records, evictions = collector.records, collector.evictions
    evicted_bytes, resident_max = collector.evicted_bytes, collector.resident_max
    cost = config.cost

    if config.concurrency == 1:
        ordered = list(requests)
    else:
        ordered = sorted(requests, key=lambda r: (r.arrival_s, r.index))
    arrivals: list[float] = []
    uncached_costs: list[list[float]] = []
    cached: dict[int, float] = {}
    for request in ordered:
        finished = collector.outcomes[request.index]
        # When the models did not sleep at all, charge every stage's cost here. (A stage that
        # restores the whole prompt sleeps its restore in the model's full_restore.)
        unslept_s = 0.0
        for position, (k, c) in enumerate(zip(finished.restored, finished.computed, strict=True)):
            restored[position] += k
            computed[position] += c
            hits[position] += k > 0
            if not slept:
                unslept_s += cost.stage_cost(
                    computed_tokens=c,
                    restored_bytes=k * config.bytes_per_token,
                    stage_index=position,
                )
        cached[request.index] = finished.finished_s - finished.started_s + unslept_s
        arrivals.append(finished.started_s)  # from the first arrival, as the replay's clock
        uncached_costs.append(
            [cost.uncached_stage_cost(request.input_length, s) for s in range(stage_count)]
        )

    if config.concurrency == 1:
        # One at a time: each request starts when the previous one finished, so its uncached
        # time is just the sum of its stages' costs.
        uncached = [sum(costs) for costs in uncached_costs]
    else:
        finishes = pipeline_finish_times(arrivals, uncached_costs, concurrency=config.concurrency)
        uncached = [finish - arrival for finish, arrival in zip(finishes, arrivals, strict=True)]

    outcomes = []
    for request, uncached_s in zip(ordered, uncached, strict=True):
        outcomes.append(
            RequestOutcome(
                index=request.index,
                input_length=request.input_length,
                restored_tokens=collector.outcomes[request.index].restored,
                ttft_cached_s=cached[request.index],
                ttft_uncached_s=uncached_s,
            )
        )
    outcomes.sort(key=lambda outcome: outcome.index)
    finishes_s = [value.finished_s for value in collector.outcomes.values()]
    first_arrival = min(arrivals, default=0.0)
    stages = tuple(
        StageSummary(
            stage_id=collector.stage_ids[position],
            restored_tokens=restored[position],
            computed_tokens=computed[position],
            hits=hits[position],
            records=records[position],
            evictions=evictions[position],
            evicted_bytes=evicted_bytes[position],
            resident_bytes_max=resident_max[position],
            accounting=accounting[position],
        )
        for position in range(stage_count)
    )
    return ReplayResult(
        config=config,
        capacity_tokens=capacity,
        requests=len(requests),
        prompt_tokens=sum(request.input_length for request in requests),
        restored_tokens=restored[0],
        theoretical=theoretical,
        stages=stages,
        ttft_cached=percentiles([o.ttft_cached_s for o in outcomes]),
        ttft_uncached=percentiles([o.ttft_uncached_s for o in outcomes]),
        wall_s=wall_s,
        virtual_s=(
            sum(cached.values())
            if config.concurrency == 1
            else max(finishes_s, default=0.0) - first_arrival
        ),
        outcomes=tuple(outcomes),
        arrival_span_s=(
            float(max(r.arrival_s for r in requests) - min(r.arrival_s for r in requests))
            if requests
            else 0.0
        ),
    )


def run_replay(
    requests: Sequence[SimRequest],
    config: SimConfig,
    *,
    capacity_tokens: int | None = None,
    theoretical: TheoreticalMax | None = None,
    progress: ProgressCallback | None = None,
    virtual_time: bool | None = None,
) -> ReplayResult:
    """Run :func:`replay` in a fresh trio run on a virtual clock (from synchronous code).

    Returns:
        The replay's result.
    """
    clock = trio.testing.MockClock(autojump_threshold=0)

    async def main() -> ReplayResult:
        return await replay(
            requests,
            config,
            capacity_tokens=capacity_tokens,
            theoretical=theoretical,
            progress=progress,
            virtual_time=virtual_time,
        )

    return trio.run(main, clock=clock)


def run_sweep(
    requests: Sequence[SimRequest],
    config: SimConfig,
    capacities: Sequence[int],
    *,
    progress: ProgressCallback | None = None,
) -> list[ReplayResult]:
    """Replay the same requests once per cache capacity (tokens per stage; 0 = unbounded).

    Returns:
        One result per capacity, in the given order.
    """
    for capacity in capacities:
        config.check_capacity(capacity)
    theoretical = theoretical_max_hit_ratio(requests, block_size=config.block_size)
    results = []
    for done, capacity in enumerate(capacities):
        base = done * len(requests)

        def shifted(count: int, base: int = base) -> None:
            if progress is not None:
                progress(base + count)

        results.append(
            run_replay(
                requests,
                config,
                capacity_tokens=capacity,
                theoretical=theoretical,
                progress=shifted,
            )
        )
    return results
