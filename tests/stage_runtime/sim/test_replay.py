"""Replays through the real pipeline, checked against hit ratios and times worked by hand.

The hand-worked trace uses 16-token blocks, min_tokens = stride = 16 and record limit 2, so a
prompt of N tokens looks up [N, grid floor, ..., 16] and records [N, grid floor]:

- r0 ids [1,2,3], 40 tokens: miss; records 40 and 32.
- r1 ids [1,2,4], 40 tokens: 40 misses (block 3 differs), 32 hits; records 40 and 32 again.
- r2 ids [1,5], 20 tokens: 20 and 16 miss (16 tokens of block 1 were never recorded alone).
- r3 ids [1,5,6], 48 tokens: 48 and 32 miss, 16 hits (recorded by r2).

Restored: 0 + 32 + 0 + 16 = 48 of 148 tokens at every stage; an infinite block cache would
restore 32 + 16 + (16 + 4) = 68.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

import attrs
import numpy as np
import pytest
import trio

from stage_runtime import CacheIndex, ConfigError, PageEviction
from stage_runtime.sim import (
    PAGED_MAX_ENTRIES,
    CostModel,
    SimConfig,
    SimRequest,
    StageReplay,
    admission_order,
    kv_cache_config,
    pipeline_finish_times,
    read_demo_trace,
    replay,
    result_to_json,
    run_replay,
    run_sweep,
    stage_configs,
    summarise_replay,
    validate_requests,
)

P = 1e-3  # prefill seconds per token


def _request(index: int, ids: list[int], length: int, arrival_s: float = 0.0) -> SimRequest:
    return SimRequest(index=index, arrival_s=arrival_s, input_length=length, block_ids=tuple(ids))


HAND_TRACE = [
    _request(0, [1, 2, 3], 40),
    _request(1, [1, 2, 4], 40),
    _request(2, [1, 5], 20),
    _request(3, [1, 5, 6], 48),
]


def _config(**overrides: object) -> SimConfig:
    settings: dict[str, object] = {
        "stages": 2,
        "block_size": 16,
        "bytes_per_token": 2,
        "cost": CostModel(prefill_s_per_token=P, restore_s_per_byte=0.0),
    }
    settings.update(overrides)
    return SimConfig(**settings)  # type: ignore[arg-type]


def test_hand_worked_trace_hit_ratios() -> None:
    """Every stage restores 32 tokens for r1 and 16 for r3: 48 of 148, theory 68 of 148."""
    result = run_replay(HAND_TRACE, _config())
    assert [o.restored_tokens for o in result.outcomes] == [(0, 0), (32, 32), (0, 0), (16, 16)]
    assert (result.requests, result.prompt_tokens, result.restored_tokens) == (4, 148, 48)
    assert result.token_hit_ratio == 48 / 148
    assert (result.theoretical.hit_tokens, result.theoretical.ratio) == (68, 68 / 148)
    for stage in result.stages:
        assert (stage.restored_tokens, stage.computed_tokens, stage.hits) == (48, 100, 2)
        assert (stage.records, stage.evictions) == (8, 0)
        # 40+32 (r0), 40 (r1; its 32 replaces r0's), 20+16 (r2), 48+32 (r3): 228 tokens x 2 B.
        assert stage.resident_bytes_max == 456


def test_hand_worked_ttft_with_and_without_cache() -> None:
    """One at a time, TTFT is the sum of stage costs: computed tokens plus restored bytes."""
    restore = 1e-4
    config = _config(cost=CostModel(prefill_s_per_token=P, restore_s_per_byte=restore))
    result = run_replay(HAND_TRACE, config)
    cached = [o.ttft_cached_s for o in result.outcomes]
    uncached = [o.ttft_uncached_s for o in result.outcomes]
    assert cached == pytest.approx(
        [2 * 40 * P, 2 * (8 * P + 64 * restore), 2 * 20 * P, 2 * (32 * P + 32 * restore)]
    )
    assert uncached == pytest.approx([2 * 40 * P, 2 * 40 * P, 2 * 20 * P, 2 * 48 * P])
    assert result.ttft_uncached.p50 == pytest.approx(2 * 40 * P)


def test_capacity_forces_evictions_that_cost_hits() -> None:
    """64-byte stage caches: an unrelated prompt evicts r0's pages before r1 can reuse them.

    r0 records 40 (80 B, oversize) then 32 (evicts 40); rX records 32 (evicts r0's 32) and 16
    (evicts rX's 32); r1 misses, records 40 (evicts rX's 16) and 32 (evicts 40): 5 evictions.
    """
    trace = [_request(0, [1, 2, 3], 40), _request(1, [7, 8], 32), _request(2, [1, 2, 4], 40)]
    unbounded = run_replay(trace, _config())
    assert [o.restored_tokens[0] for o in unbounded.outcomes] == [0, 0, 32]
    bounded = run_replay(trace, _config(capacity_tokens=32))
    assert bounded.config.max_bytes() == 64
    assert [o.restored_tokens[0] for o in bounded.outcomes] == [0, 0, 0]
    for stage in bounded.stages:
        assert (stage.evictions, stage.evicted_bytes) == (5, 80 + 64 + 64 + 32 + 80)
        assert stage.resident_bytes_max == 80
    assert bounded.theoretical.ratio == unbounded.theoretical.ratio == 32 / 112


def test_sweep_gives_one_result_per_capacity_in_order() -> None:
    """A sweep replays once per capacity; more capacity never restores less here."""
    trace = [_request(0, [1, 2, 3], 40), _request(1, [7, 8], 32), _request(2, [1, 2, 4], 40)]
    results = run_sweep(trace, _config(), [32, 0])
    assert [r.capacity_tokens for r in results] == [32, 0]
    assert [r.restored_tokens for r in results] == [0, 32]
    counts: list[int] = []
    run_sweep(trace, _config(), [32, 0], progress=counts.append)
    assert counts == list(range(1, 2 * len(trace) + 1))  # one tick per request, across runs
    with pytest.raises(ConfigError, match="capacity_tokens must be an integer >= 0, got -1"):
        run_sweep(trace, _config(), [-1])
    with pytest.raises(ConfigError, match="capacity_tokens 9,223,372,036,854,775,808 x"):
        run_sweep(trace, _config(), [32, 2**63])


def test_concurrency_replays_arrivals_in_virtual_time() -> None:
    """Concurrency 2: r1 arrives at 10 ms, queues behind r0 at each stage; TTFT counts it."""
    trace = [_request(0, [1, 2, 3], 40, arrival_s=0.0), _request(1, [7], 16, arrival_s=0.01)]
    result = run_replay(trace, _config(concurrency=2))
    # r0: stage 0 until 40 ms, stage 1 until 80 ms. r1: stage 0 40-56 ms, stage 1 80-96 ms.
    assert [o.ttft_cached_s for o in result.outcomes] == pytest.approx([0.08, 0.086])
    finishes = pipeline_finish_times([0.0, 0.01], [[40 * P] * 2, [16 * P] * 2], concurrency=2)
    assert [o.ttft_uncached_s for o in result.outcomes] == pytest.approx([0.08, finishes[1] - 0.01])
    assert result.virtual_s == pytest.approx(0.096)
    one_at_a_time = run_replay(trace, _config(concurrency=1))
    assert [o.ttft_cached_s for o in one_at_a_time.outcomes] == pytest.approx([0.08, 0.032])


def test_concurrent_replay_reports_load_and_queueing_worked_by_hand() -> None:
    """r0 (40 tokens) at 0 and r1 (16) at 10 ms: each stage has 28 ms of work per request for
    one arrival per 10 ms (load 2.8), and r1 waits 30 ms at stage 0 and 24 ms at stage 1: 54
    of the 166 ms of time to first token are queueing."""
    trace = [_request(0, [1, 2, 3], 40, arrival_s=0.0), _request(1, [7], 16, arrival_s=0.01)]
    result = run_replay(trace, _config(concurrency=2))
    assert result.arrival_span_s == pytest.approx(0.01)
    load = result.offered_load
    assert load is not None
    assert [load.cached, load.uncached] == pytest.approx([2.8, 2.8])
    assert result.waiting_share == pytest.approx(0.054 / 0.166)
    # One request after another, arrivals do not pace the replay and nothing queues.
    one_at_a_time = run_replay(trace, _config(concurrency=1))
    assert one_at_a_time.arrival_span_s == pytest.approx(0.01)
    assert one_at_a_time.offered_load is None
    assert one_at_a_time.waiting_share is None


def test_requests_arriving_at_once_have_no_load_but_a_queueing_share() -> None:
    """Two 16-token prompts at the same instant, concurrency 2: no arrival rate, so no load,
    but the second waits 16 ms for stage 0 (r0 there 0-16 ms, at stage 1 16-32; r1 at stage 0
    16-32, stage 1 32-48): 16 of the 32 + 48 ms of time to first token are queueing."""
    trace = [_request(0, [1], 16, arrival_s=5.0), _request(1, [2], 16, arrival_s=5.0)]
    result = run_replay(trace, _config(concurrency=2))
    assert result.arrival_span_s == 0.0
    assert result.offered_load is None
    assert [o.ttft_cached_s for o in result.outcomes] == pytest.approx([0.032, 0.048])
    assert result.waiting_share == pytest.approx(0.016 / 0.080)
    document = result_to_json(result)
    assert document["offered_load"] is None
    assert document["ttft_waiting_share"] == pytest.approx(0.2)
    # A single request at concurrency 2 waits for nothing: a share of 0, not None.
    alone = run_replay(trace[:1], _config(concurrency=2))
    assert (alone.offered_load, alone.waiting_share) == (None, 0.0)


def test_load_counts_each_stage_at_its_own_costs_restores_included() -> None:
    """Stages at 1 and 3 ms per token, restores at 1 ms per byte (2 bytes per token); the same
    40-token prompt at 0 and 10 ms. r0 computes: 40 + 120 ms. r1 restores all 40 tokens at both
    stages: 80 ms each. Busiest stage, stage 1: 120 + 80 ms with the cache, 2 x 120 ms without,
    per 2 requests, one per 10 ms: loads 10 and 12. r1 waits 30 ms for stage 0 (free at 40)
    and 40 ms for stage 1 (free at 160): 70 of 160 + 230 ms."""
    cost = CostModel(stage_prefill_s_per_token=(1e-3, 3e-3), restore_s_per_byte=1e-3)
    again = [_request(0, [1, 2, 3], 40, arrival_s=0.0), _request(1, [1, 2, 3], 40, arrival_s=0.01)]
    result = run_replay(again, _config(concurrency=2, cost=cost))
    assert [o.restored_tokens for o in result.outcomes] == [(0, 0), (40, 40)]
    assert [o.ttft_cached_s for o in result.outcomes] == pytest.approx([0.16, 0.23])
    load = result.offered_load
    assert load is not None
    assert [load.cached, load.uncached] == pytest.approx([10.0, 12.0])
    assert result.waiting_share == pytest.approx(0.07 / 0.39)


def test_load_and_queueing_agree_with_the_fifo_pipeline_model() -> None:
    """On a seeded random workload (uneven stages, costly restores, bursts), the load and the
    queueing share equal those computed from the FIFO pipeline model of the same costs."""
    rng = np.random.default_rng(7)
    trace = []
    for i in range(40):
        ids = [int(x) for x in rng.integers(1, 4, size=int(rng.integers(1, 5)))]
        length = int(rng.integers(1, 16 * len(ids) + 1))
        burst = float(rng.choice([0.0, 0.05, 0.1]))
        trace.append(_request(i, ids, length, arrival_s=burst + i * 0.02))
    cost = CostModel(stage_prefill_s_per_token=(1e-3, 4e-3, 2e-3), restore_s_per_byte=2e-4)
    config = _config(stages=3, concurrency=4, cost=cost)
    result = run_replay(trace, config)
    by_index = {r.index: r for r in trace}
    outcomes = sorted(result.outcomes, key=lambda o: (by_index[o.index].arrival_s, o.index))
    work = [
        [
            cost.stage_cost(
                computed_tokens=o.input_length - k, restored_bytes=2 * k, stage_index=stage
            )
            for stage, k in enumerate(o.restored_tokens)
        ]
        for o in outcomes
    ]
    arrivals = [by_index[o.index].arrival_s for o in outcomes]
    finishes = pipeline_finish_times(arrivals, work, concurrency=4)
    ttfts = [finish - arrival for finish, arrival in zip(finishes, arrivals, strict=True)]
    assert [o.ttft_cached_s for o in outcomes] == pytest.approx(ttfts)
    assert 1 - sum(map(sum, work)) / sum(ttfts) > 0.1  # the workload does queue
    assert result.waiting_share == pytest.approx(1 - sum(map(sum, work)) / sum(ttfts))
    span = max(arrivals) - min(arrivals)
    busiest = max(sum(row[stage] for row in work) for stage in range(3))
    load = result.offered_load
    assert load is not None
    assert load.cached == pytest.approx(busiest * (len(trace) - 1) / len(trace) / span)
    prompt = sum(r.input_length for r in trace)
    assert load.uncached == pytest.approx(prompt * 4e-3 * (len(trace) - 1) / len(trace) / span)


def test_the_stage_sleeps_change_no_figure_of_a_concurrent_replay() -> None:
    """Times are computed from each stage's costs per request, so a concurrent replay whose
    stages skip their sleeps (virtual_time=False) reports what the sleeping one does."""
    trace = [
        _request(0, [1, 2, 3], 40, arrival_s=0.0),
        _request(1, [1, 2, 4], 40, arrival_s=0.001),
        _request(2, [9], 16, arrival_s=0.001),
        _request(3, [1, 2, 3], 44, arrival_s=0.2),
    ]
    config = _config(concurrency=2)
    slept = result_to_json(run_replay(trace, config))
    unslept = result_to_json(run_replay(trace, config, virtual_time=False))
    for document in (slept, unslept):
        del document["wall_s"], document["tokens_per_s"]
    assert unslept == slept
    share = slept["ttft_waiting_share"]
    assert isinstance(share, float)
    assert share > 0  # the requests do queue


def test_arrivals_too_close_to_measure_give_no_load() -> None:
    """Two arrivals 1e-320 s apart: the load would be infinite; it is None instead."""
    trace = [_request(0, [1], 16), _request(1, [2], 16, arrival_s=1e-320)]
    result = run_replay(trace, _config(concurrency=2))
    assert result.arrival_span_s > 0
    assert result.offered_load is None


async def test_replay_embeds_in_a_trio_program(autojump_clock: trio.testing.MockClock) -> None:
    """replay() runs inside the caller's trio run; with virtual_time its costs pass on the
    caller's clock, and they add up to the TTFTs the sleep-free default computes."""
    restore = 1e-4
    config = _config(cost=CostModel(prefill_s_per_token=P, restore_s_per_byte=restore))
    before = trio.current_time()
    slept = await replay(HAND_TRACE, config, virtual_time=True)
    elapsed = trio.current_time() - before
    assert slept.restored_tokens == 48
    assert elapsed == pytest.approx(sum(o.ttft_cached_s for o in slept.outcomes))
    assert slept.virtual_s == pytest.approx(elapsed)
    added_up = await replay(HAND_TRACE, config)
    assert trio.current_time() - before == pytest.approx(elapsed)  # no sleeping this time
    assert [o.ttft_cached_s for o in added_up.outcomes] == pytest.approx(
        [o.ttft_cached_s for o in slept.outcomes]
    )
    assert added_up.virtual_s == pytest.approx(elapsed)


def test_stage_configs_carry_the_cache_settings() -> None:
    """Stages get contiguous layers, neighbours and the capacity as max_bytes."""
    config = _config(stages=3, capacity_tokens=100, record_limit=4, max_entries=9)
    stages = stage_configs(config)
    assert [s.stage_id for s in stages] == ["stage-0", "stage-1", "stage-2"]
    assert [(s.layer_start, s.layer_end) for s in stages] == [(0, 8), (8, 16), (16, 24)]
    assert (stages[0].upstream, stages[0].downstream) == (None, "stage-1")
    cache = kv_cache_config(config)
    assert all(s.kv_cache == cache for s in stages)
    assert (cache.max_bytes, cache.max_entries, cache.shared_prefix_record_limit) == (200, 9, 4)
    assert (cache.min_tokens, cache.shared_prefix_stride_tokens) == (16, 16)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"stride_tokens": 0}, "stride 0 leaves no lookup grid for record_limit 2"),
        ({"capacity_tokens": -1}, "capacity_tokens must be an integer >= 0, got -1"),
        ({"stages": 0}, "stages must be an integer >= 1, got 0"),
        ({"concurrency": 0}, "concurrency must be an integer >= 1, got 0"),
        ({"block_size": 2**20 + 1}, "block_size must be <= 1,048,576, got 1,048,577"),
        ({"bytes_per_token": 2**24 + 1}, "bytes_per_token must be <= 16,777,216, got 16,777,217"),
        (
            {"capacity_tokens": 2**63, "bytes_per_token": 2},
            "capacity_tokens 9,223,372,036,854,775,808 x bytes_per_token 2 must be <= "
            "18,446,744,073,709,551,615 bytes",
        ),
    ],
)
def test_impossible_settings_are_refused(kwargs: dict[str, object], message: str) -> None:
    """SimConfig refuses impossible settings with a ConfigError naming the field."""
    with pytest.raises(ConfigError, match=message):
        _config(**kwargs)


def test_demo_excerpt_replays_with_real_sharing() -> None:
    """The first 60 requests of the bundled excerpt restore a real share of their tokens."""
    requests = read_demo_trace(limit=60).requests
    result = run_replay(requests, SimConfig())
    assert 0 < result.token_hit_ratio <= result.theoretical.ratio
    assert len(result.stages) == 4
    assert all(
        stage.computed_tokens + stage.restored_tokens == result.prompt_tokens
        for stage in result.stages
    )


async def test_example_program_restores_shared_prompts(
    autojump_clock: trio.testing.MockClock, capsys: pytest.CaptureFixture[str]
) -> None:
    """examples/multi_stage_simulation.py restores a real share, never above the theory."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).parents[3] / "examples" / "multi_stage_simulation.py"
    spec = importlib.util.spec_from_file_location("example_multi_stage_simulation", path)
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    figures = await module.main()
    assert 0.3 < figures["hit_ratio"] <= figures["theoretical_max"]
    assert "requests: stage 0 restored" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("requests", "message"),
    [
        ([_request(0, [1], 17)], "request 0: input_length must be <= block_size"),
        (  # not only the last request's blocks are checked
            [_request(0, [1], 8), _request(1, [2], 17), _request(2, [3], 8)],
            "request 1: input_length must be <= block_size",
        ),
        (
            [
                SimRequest(index=3, input_length=9, block_ids=(1, 2), block_lengths=(4, 4)),
                _request(5, [3], 8),
            ],
            "request 3: block_lengths must give one length",
        ),
        ([_request(0, [1], 8), _request(0, [2], 8)], "request 0: index must be unique"),
        (
            [SimRequest(index=4, input_length=9, block_ids=(1, 2), block_lengths=(4, 4))],
            "request 4: block_lengths must give one length",
        ),
        (  # a replay at concurrency > 1 waited for it forever
            [_request(0, [1], 8), _request(1, [2], 8, arrival_s=float("inf"))],
            "request 1: arrival_s must be a finite number, got inf",
        ),
        # Fields of the wrong type (a SimRequest is not checked when it is made) used to fail
        # in the tokenizer or the theoretical maximum with a TypeError or ValueError that did
        # not name the request, or (a float) to be truncated silently.
        (
            [_request(0, [1], 8), _request(1, [2, "x"], 20), _request(2, [3], 8)],  # type: ignore[list-item]
            "request 1: block_ids must hold integers, got 'x' at position 1",
        ),
        (
            [_request(0, [1], 8), _request(1, [2, 2.5], 20)],  # type: ignore[list-item]
            "request 1: block_ids must hold integers, got 2.5 at position 1",
        ),
        (
            [_request(0, [1], 8), SimRequest(index=1, input_length=8, block_ids=None)],  # type: ignore[arg-type]
            "request 1: block_ids must be a sequence of integers, got None",
        ),
        (
            [_request(0, [1], 8), _request(1, [2], 8.5)],  # type: ignore[arg-type]
            "request 1: input_length must be an integer, got 8.5",
        ),
        (
            [_request(0, [1], 8), _request(1, [2], True)],
            "request 1: input_length must be an integer, got True",
        ),
        (
            [
                _request(0, [1], 8),
                SimRequest(index=1, input_length=8, block_ids=(1, 2), block_lengths=(4.5, 3.5)),  # type: ignore[arg-type]
            ],
            "request 1: block_lengths must hold integers, got 4.5 at position 0",
        ),
        (
            [_request(0, [1], 8), _request("a", [2], 8)],  # type: ignore[arg-type]
            "request at position 1: index must be an integer, got 'a'",
        ),
    ],
)
def test_unusable_requests_are_refused_before_the_replay(
    requests: list[SimRequest], message: str
) -> None:
    """Requests that cannot become prompts raise ConfigError naming them, before any work
    (in a sweep too, whose theoretical maximum is computed first)."""
    with pytest.raises(ConfigError, match=message):
        run_replay(requests, _config())
    with pytest.raises(ConfigError, match=message):
        run_sweep(requests, _config(), [0, 64])


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        # A block size of 0 blamed the first request ("input_length must be <= block_size *
        # len(block_ids) = 0"); a string was a TypeError.
        ({"block_size": 0}, r"block_size must be an integer in \[4, 1,048,576\], got 0"),
        ({"block_size": "16"}, r"block_size must be an integer in \[4, 1,048,576\], got '16'"),
        ({"block_size": 2**20 + 1}, r"block_size must be an integer in \[4, 1,048,576\]"),
        ({"block_size": 16, "max_input_length": 0}, "max_input_length must be an integer >= 1"),
        ({"block_size": 16, "max_input_length": 1.5}, "max_input_length must be an integer >= 1"),
    ],
)
def test_validate_requests_names_a_bad_setting_not_a_request(
    arguments: dict[str, object], message: str
) -> None:
    """validate_requests checks its own settings first, as the replay's SimConfig does."""
    with pytest.raises(ConfigError, match=message) as caught:
        validate_requests(HAND_TRACE, **arguments)  # type: ignore[arg-type]
    assert "request" not in str(caught.value)


@pytest.mark.parametrize(
    ("capacity", "shown"), [(-5, "-5"), (1500.7, "1500.7"), (True, "True"), ("100", "'100'")]
)
def test_every_capacity_argument_is_checked_by_name(capacity: Any, shown: str) -> None:
    """A capacity that is not an integer >= 0 is named as capacity_tokens wherever it is
    given: a float used to be refused as max_bytes, True to replay a one-token cache, and
    summarise_replay took -5 as unbounded."""
    config = _config()
    message = f"capacity_tokens must be an integer >= 0, got {shown}"
    stages = [
        StageReplay(
            stage_id=f"stage-{index}",
            restored_tokens=(0,) * len(HAND_TRACE),
            computed_tokens=tuple(r.input_length for r in HAND_TRACE),
            records=0,
            evictions=0,
            evicted_bytes=0,
            resident_bytes_max=0,
        )
        for index in range(config.stages)
    ]
    calls: list[Callable[[], object]] = [
        lambda: kv_cache_config(config, capacity_tokens=capacity),
        lambda: stage_configs(config, capacity_tokens=capacity),
        lambda: config.max_bytes(capacity),
        lambda: config.as_dict(capacity),
        lambda: summarise_replay(HAND_TRACE, config, stages, capacity_tokens=capacity),
        lambda: run_replay(HAND_TRACE, config, capacity_tokens=capacity),
        lambda: run_sweep(HAND_TRACE, config, [0, capacity]),
    ]
    for call in calls:
        with pytest.raises(ConfigError, match=re.escape(message)):
            call()
    assert summarise_replay(HAND_TRACE, config, stages, capacity_tokens=0).capacity_tokens == 0


@pytest.mark.parametrize("concurrency", [0, -1, 1.0, None])
def test_admission_order_refuses_a_concurrency_that_is_not_a_count(concurrency: object) -> None:
    """admission_order names a concurrency below 1 (0 used to sort by arrival silently)."""
    with pytest.raises(ConfigError, match="concurrency must be an integer >= 1, got "):
        admission_order(HAND_TRACE, concurrency)  # type: ignore[arg-type]


def test_arrivals_spanning_more_than_1e9_s_are_refused_only_when_they_pace_the_replay() -> None:
    """Above concurrency 1 the virtual clock counts from the first arrival, and 2e9 s from it a
    float clock cannot resolve the stage costs: refused. One request at a time the timestamps
    are not used (file order), so the same workload replays (it used to be refused too)."""
    far = [_request(0, [1, 2], 32), _request(1, [1, 2], 32, arrival_s=2e9)]
    message = (
        r"^arrivals must span at most 1e\+09 s \(about 31 years\) at concurrency > 1, "
        r"got 2e\+09 s, from request 0 to request 1$"
    )
    with pytest.raises(ConfigError, match=message):
        run_replay(far, _config(concurrency=2))
    with pytest.raises(ConfigError, match=message):
        run_sweep(far, _config(concurrency=2), [0, 64])
    with pytest.raises(ConfigError, match=message):
        validate_requests(far, block_size=16, concurrency=2)
    validate_requests(far, block_size=16)  # concurrency 1 by default, as SimConfig's
    result = run_replay(far, _config())
    assert [o.restored_tokens for o in result.outcomes] == [(0, 0), (32, 32)]
    assert result.arrival_span_s == 2e9
    assert result.offered_load is None
    assert [o.ttft_cached_s for o in result.outcomes] == pytest.approx([2 * 32 * P, 0.0])
    # (16 tokens hold the 16-token rung of the ladder.)
    assert [r.restored_tokens for r in run_sweep(far, _config(), [0, 16])] == [32, 16]


def test_a_prompt_longer_than_the_context_is_refused_before_the_replay() -> None:
    """A request longer than the stages' ctx_size, anywhere in the workload, is named before
    any prefill; it used to pass the checks and stop the replay when its turn came, with the
    pipeline's error (in an exception group) that did not say which request it was."""
    requests = [_request(0, [1], 8), _request(1, [2, 3, 4], 40), _request(2, [5], 8)]
    message = r"request 1: input_length must be <= 32 \(the stages' ctx_size\), got 40"
    with pytest.raises(ConfigError, match=message):
        run_replay(requests, _config(ctx_size=32))
    with pytest.raises(ConfigError, match=message):
        validate_requests(requests, block_size=16, max_input_length=32)
    validate_requests(requests, block_size=16)  # no limit given: none applies


def test_concurrent_replay_times_follow_the_fifo_pipeline_model() -> None:
    """At concurrency 3, measured TTFTs equal the FIFO tandem-queue model of the same costs."""
    trace = [
        _request(0, [1, 2, 3], 40, arrival_s=0.0),
        _request(1, [1, 2, 4], 40, arrival_s=0.001),
        _request(2, [9], 16, arrival_s=0.002),
        _request(3, [1, 2, 3], 44, arrival_s=0.003),
        _request(4, [8, 7], 30, arrival_s=0.2),
    ]
    config = _config(stages=3, concurrency=3)
    result = run_replay(trace, config)
    costs = [
        [(o.input_length - restored) * P for restored in o.restored_tokens] for o in result.outcomes
    ]
    arrivals = [r.arrival_s for r in trace]
    finishes = pipeline_finish_times(arrivals, costs, concurrency=3)
    expected = [f - a for f, a in zip(finishes, arrivals, strict=True)]
    assert [o.ttft_cached_s for o in result.outcomes] == pytest.approx(expected)
    # r1 queues behind r0 at every stage, so r0 is recorded there before r1 is looked up.
    assert [o.restored_tokens for o in result.outcomes] == [
        (0, 0, 0),
        (32, 32, 32),
        (0, 0, 0),
        (32, 32, 32),
        (0, 0, 0),
    ]


@pytest.mark.parametrize("index", ["ladder", "paged"])
def test_a_whole_prompt_restore_occupies_its_stage_in_a_concurrent_replay(index: str) -> None:
    """A stage that restores every token runs no forward, but its restore still takes its
    stage's time: later requests queue behind it, as in the FIFO model of the same costs."""
    restore_per_byte = 1e-5
    trace = [_request(i, [1, 2, 3], 40) for i in range(3)]  # all arrive at 0
    config = _config(
        concurrency=3,
        bytes_per_token=4,
        index=index,
        cost=CostModel(prefill_s_per_token=25e-6, restore_s_per_byte=restore_per_byte),
    )
    result = run_replay(trace, config)
    assert [o.restored_tokens for o in result.outcomes] == [(0, 0), (40, 40), (40, 40)]
    costs = [
        [
            (o.input_length - k) * 25e-6 + k * config.bytes_per_token * restore_per_byte
            for k in o.restored_tokens
        ]
        for o in result.outcomes
    ]
    finishes = pipeline_finish_times([0.0] * 3, costs, concurrency=3)
    assert [o.ttft_cached_s for o in result.outcomes] == pytest.approx(finishes)  # 2.0/4.2/5.8 ms
    assert result.virtual_s == pytest.approx(finishes[-1])


@pytest.mark.parametrize("shift_s", [2.0**40, 2.0**44])  # epoch seconds in ms and in us
def test_a_concurrent_replay_measures_time_from_the_first_arrival(shift_s: float) -> None:
    """Shifting every timestamp by the same amount changes nothing. Measured from 0, arrivals
    at epoch-microsecond scale left the clock too coarse for the costs (TTFTs rounded, or 0).
    The offsets are exact at both shifts, so the shifted trace is the same trace."""
    trace = [
        _request(0, [1, 2, 3], 40, arrival_s=0.0),
        _request(1, [1, 2, 4], 40, arrival_s=2.0**-8),
        _request(2, [9], 16, arrival_s=0.25),
    ]
    shifted = [attrs.evolve(r, arrival_s=shift_s + r.arrival_s) for r in trace]
    config = _config(stages=3, concurrency=2)
    expected = run_replay(trace, config)
    got = run_replay(shifted, config)
    for field in ("ttft_cached_s", "ttft_uncached_s"):
        want = [getattr(o, field) for o in expected.outcomes]
        assert min(want) > 0.01
        assert [getattr(o, field) for o in got.outcomes] == pytest.approx(want, rel=1e-12)
    assert got.virtual_s == pytest.approx(expected.virtual_s, rel=1e-12)


def test_arrivals_may_be_numpy_numbers_or_negative() -> None:
    """Any finite real arrival works: time counts from the first one."""
    trace = [
        _request(0, [1, 2, 3], 40, arrival_s=np.float32(-0.5)),  # type: ignore[arg-type]
        _request(1, [1, 2, 4], 40, arrival_s=np.int64(0)),  # type: ignore[arg-type]
    ]
    result = run_replay(trace, _config(concurrency=2))
    assert [o.restored_tokens[0] for o in result.outcomes] == [0, 32]


def test_slowest_stage_sets_the_pace_of_a_concurrent_replay() -> None:
    """Per-stage costs: back-to-back requests leave the pipeline at the slowest stage's pace."""
    trace = [_request(i, [100 + i], 10, arrival_s=0.0001 * i) for i in range(4)]
    cost = CostModel(stage_prefill_s_per_token=[P, 3 * P], restore_s_per_byte=0.0)
    result = run_replay(trace, _config(cost=cost, concurrency=4))
    finishes = [o.ttft_cached_s + r.arrival_s for o, r in zip(result.outcomes, trace, strict=True)]
    # Stage 0 takes 10 ms a request, stage 1 30 ms: they leave 30 ms apart after the first 40 ms.
    assert finishes == pytest.approx([0.04, 0.07, 0.10, 0.13])
    assert [o.ttft_uncached_s for o in result.outcomes] == pytest.approx(
        [o.ttft_cached_s for o in result.outcomes]
    )
    with pytest.raises(ConfigError, match="one cost per stage \\(2\\), got 3"):
        _config(cost=CostModel(stage_prefill_s_per_token=[P, P, P]))


def test_concurrency_1_keeps_file_order_and_more_follows_timestamps() -> None:
    """Timestamps against file order: one at a time replays the file's order (the second line
    restores the first's prefix); with concurrency 2 the earlier arrival goes first instead."""
    trace = [
        _request(0, [1, 2, 3], 40, arrival_s=0.5),  # first in the file, arrives last
        _request(1, [1, 2, 4], 40, arrival_s=0.0),
    ]
    in_file_order = run_replay(trace, _config(concurrency=1))
    assert [o.restored_tokens[0] for o in in_file_order.outcomes] == [0, 32]
    by_arrival = run_replay(trace, _config(concurrency=2))
    assert [o.restored_tokens[0] for o in by_arrival.outcomes] == [32, 0]


def test_requests_arriving_together_reach_the_stages_in_file_order() -> None:
    """Admission order breaks ties of arrival by file order, at every stage. Each prompt
    extends the previous one by a block, so any other order would restore something else."""
    trace = [_request(i, list(range(1, i + 2)), 16 * (i + 1)) for i in range(40)]
    result = run_replay(trace, _config(concurrency=40))
    assert [o.restored_tokens for o in result.outcomes] == [(16 * i, 16 * i) for i in range(40)]


def test_the_grid_spacing_is_the_stride_capped_at_the_min_tokens() -> None:
    """As in the upstream: min 100 with stride 512 puts the grid every 100 tokens, so the first
    prompt records 1,024 and 1,000 (not 512), and a second one sharing only its first 512
    tokens restores nothing (a 512-token grid would have restored 512). The JSON says which
    stride applied."""
    config = SimConfig(stages=1, block_size=512, min_tokens=100, stride_tokens=512)
    trace = [
        SimRequest(index=0, input_length=1024, block_ids=(1, 2)),
        SimRequest(index=1, input_length=1024, block_ids=(1, 3)),
    ]
    assert config.effective_stride == 100
    result = run_replay(trace, config)
    assert result.stages[0].restored_tokens == 0  # 1,000 and 1,024 were recorded: no 500 there
    document = config.as_dict()
    assert (document["stride_tokens"], document["effective_stride_tokens"]) == (512, 100)


def test_paged_records_count_the_prompts_that_stored_pages() -> None:
    """With --index paged, a prompt whose pages were all cached already stores nothing: three
    identical prompts make one record per stage, not three."""
    config = SimConfig(stages=2, block_size=16, bytes_per_token=2, index="paged")
    trace = [SimRequest(index=i, input_length=64, block_ids=(1, 2, 3, 4)) for i in range(3)]
    result = run_replay(trace, config)
    assert [stage.records for stage in result.stages] == [1, 1]
    assert [stage.restored_tokens for stage in result.stages] == [128, 128]


def test_the_environment_does_not_change_a_simulation(monkeypatch: pytest.MonkeyPatch) -> None:
    """The cache kill switch and bounds in the environment are for serving stages: a replay is
    what its SimConfig says (it used to restore 0% under STAGE_RUNTIME_KV_CACHE=off)."""
    trace = [SimRequest(index=i, input_length=64, block_ids=(1, 2, 3, 4)) for i in range(2)]
    config = SimConfig(stages=2, block_size=16, bytes_per_token=2)
    expected = run_replay(trace, config).restored_tokens
    assert expected > 0
    monkeypatch.setenv("STAGE_RUNTIME_KV_CACHE", "off")
    monkeypatch.setenv("STAGE_RUNTIME_KV_CACHE_MAX_ENTRIES", "1")
    assert run_replay(trace, config).restored_tokens == expected


def test_the_paged_index_defaults_to_a_page_count_bound_not_the_ladders_64() -> None:
    """SimConfig gives --index paged the same default as the command line: every page is an
    entry, so 64 would hold 64 pages; unset, max_entries is PAGED_MAX_ENTRIES."""
    assert SimConfig().max_entries == 64
    assert SimConfig(index="paged").max_entries == PAGED_MAX_ENTRIES == 1_000_000
    assert SimConfig(index="paged", max_entries=5).max_entries == 5
    # A copy with another index gets that index's default, unless max_entries was given.
    assert attrs.evolve(SimConfig(), index="paged").max_entries == PAGED_MAX_ENTRIES
    assert attrs.evolve(SimConfig(index="paged"), index="ladder").max_entries == 64
    assert attrs.evolve(SimConfig(max_entries=7), index="paged").max_entries == 7
    with pytest.raises(ConfigError, match=r"^max_entries must be an integer >= 1, got 0$"):
        SimConfig(max_entries=0)


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"page_eviction": "adaptive"}, "page_eviction 'adaptive' applies to index 'paged' only"),
        ({"page_eviction": "reuse"}, "page_eviction 'reuse' applies to index 'paged' only"),
        ({"page_tokens": 64}, "page_tokens 64 applies to index 'paged' only"),
        (
            {"page_tokens": 64, "page_eviction": "reuse"},
            "page_tokens 64 and page_eviction 'reuse' apply to index 'paged' only",
        ),
    ],
)
def test_page_settings_with_the_ladder_are_refused_when_the_config_is_made(
    settings: dict[str, object], message: str
) -> None:
    """The ladder has no pages and evicts by LRU only: a page size or another eviction with it
    is a ConfigError at construction (page_eviction used to fail only in run_replay, and
    page_tokens was ignored without a word), as --page-tokens is without --index paged."""
    with pytest.raises(ConfigError, match=rf"^{message} \(index is 'ladder'\)$"):
        SimConfig(**settings)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match=message):
        attrs.evolve(SimConfig(index="paged", **settings), index="ladder")  # type: ignore[arg-type]
    paged = SimConfig(index="paged", **settings)  # type: ignore[arg-type]
    assert kv_cache_config(paged).index is CacheIndex.PAGED
    assert SimConfig(page_eviction="lru").page_eviction is PageEviction.LRU  # the ladder's own


def test_numpy_integer_fields_replay_as_their_ints() -> None:
    """A hand-built request may hold numpy integers (an index, a length read from an array):
    it replays exactly as the same request with Python ints."""
    plain = [_request(0, [1, 2], 30), _request(1, [1, 2, 3], 40)]
    numpy_fields = [
        SimRequest(index=np.int64(0), input_length=np.int64(30), block_ids=(1, 2)),  # type: ignore[arg-type]
        SimRequest(index=np.int32(1), input_length=np.int32(40), block_ids=(1, 2, 3)),  # type: ignore[arg-type]
    ]
    expected = run_replay(plain, _config())
    got = run_replay(numpy_fields, _config())
    assert got.restored_tokens == expected.restored_tokens > 0
    assert got.prompt_tokens == expected.prompt_tokens == 70
    assert got.stages == expected.stages


def test_a_replays_clock_keeps_the_times_a_mock_clock_keeps() -> None:
    """run_replay's clock stands still while tasks run and jumps to each deadline once none
    can, to the same float a MockClock(autojump_threshold=0) reads."""
    import trio.testing

    from stage_runtime.sim.runs import _VirtualClock

    async def readings() -> list[float]:
        seen = [trio.current_time()]

        async def sleeper(delay: float) -> None:
            await trio.sleep(delay)
            seen.append(trio.current_time())
            await trio.lowlevel.checkpoint()
            seen.append(trio.current_time())

        async with trio.open_nursery() as nursery:
            for delay in (0.1, 0.3, 0.7, 1e-9, 0.1, 2.5):
                nursery.start_soon(sleeper, delay)
        with trio.move_on_after(1 / 3):
            await trio.sleep_forever()
        seen.append(trio.current_time())
        return seen

    mock = trio.run(readings, clock=trio.testing.MockClock(autojump_threshold=0))
    ours = trio.run(readings, clock=_VirtualClock())
    assert ours == mock
    assert ours[0] == 0.0
    assert ours[-1] > 2.5
