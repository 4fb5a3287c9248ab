"""Pipelines in paged index mode: the correctness property, salts, and the same log events."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import attrs
import numpy as np
import pytest
import trio
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from actors.testing import LogEvent, capture_actor_logs, events_named
from stage_runtime.config import CacheIndex, StageConfig
from stage_runtime.errors import ConfigError
from stage_runtime.pipeline import PrefillResult, open_pipeline
from tests.stage_runtime.pipeline_helpers import mix_factory, prompt, stage_configs, uncached

NO_ENV: dict[str, str] = {}


@pytest.fixture(autouse=True)
def logs() -> Iterator[list[LogEvent]]:
    """Capture every log event (keeps the output quiet; tests inspect them)."""
    with capture_actor_logs() as captured:
        yield captured


def paged(configs: list[StageConfig], page_tokens: int | None = None) -> list[StageConfig]:
    """The same stages with the paged index."""
    out = []
    for config in configs:
        assert config.kv_cache is not None
        kv = attrs.evolve(config.kv_cache, index=CacheIndex.PAGED, page_tokens=page_tokens)
        out.append(attrs.evolve(config, kv_cache=kv))
    return out


def restored(result: PrefillResult) -> list[int]:
    return [report.restored_tokens for report in result.stages]


async def test_paged_pipeline_restores_a_shared_prefix_off_the_grid(
    logs: list[LogEvent],
) -> None:
    """A prompt sharing 300 tokens with an earlier one restores 256 (two 128-token pages)."""
    configs = paged(stage_configs(2, max_entries=64))
    factory = mix_factory(width=4)
    first = prompt(600)
    second = np.concatenate([first[:300], prompt(200, start=10_000)])
    async with open_pipeline(configs, factory, environ=NO_ENV) as pipeline:
        await pipeline.prefill(first, session_id="a")
        result = await pipeline.prefill(second, session_id="b")
        again = await pipeline.prefill(first, session_id="c")
    async with open_pipeline(uncached(configs), factory, environ=NO_ENV) as cold:
        reference = await cold.prefill(second, session_id="b")
    assert restored(result) == [256, 256]
    assert restored(again) == [600, 600]
    np.testing.assert_allclose(result.frame.rows(), reference.frame.rows(), rtol=1e-6, atol=1e-6)
    assert len(events_named(logs, "activation_restored")) == 4
    assert events_named(logs, "activation_recorded")


@pytest.mark.parametrize("index", ["ladder", "paged"])
async def test_large_joins_of_restored_rows_run_off_the_event_loop(
    index: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Joining restored pages, and restored rows with computed ones, copies them: from
    COPY_IN_THREAD_BYTES on, in a worker thread (192 MiB took hundreds of ms on the loop).
    The results are the same as computing everything."""
    import threading

    from stage_runtime import stage as stage_module
    from stage_runtime.frames import ActivationFrame

    monkeypatch.setattr(stage_module, "COPY_IN_THREAD_BYTES", 1)  # every join
    joined_in: list[bool] = []
    concat = ActivationFrame.concat

    def watched(first: ActivationFrame, second: ActivationFrame) -> ActivationFrame:
        joined_in.append(threading.current_thread() is threading.main_thread())
        return concat(first, second)

    monkeypatch.setattr(ActivationFrame, "concat", staticmethod(watched))
    configs = stage_configs(2, max_entries=64)
    if index == "paged":
        configs = paged(configs)
    factory = mix_factory(width=4)
    first = prompt(600)
    second = np.concatenate([first, prompt(17, start=10_000)])  # extends the first
    async with open_pipeline(configs, factory, environ=NO_ENV) as pipeline:
        await pipeline.prefill(first, session_id="a")
        result = await pipeline.prefill(second, session_id="b")
    async with open_pipeline(uncached(configs), factory, environ=NO_ENV) as cold:
        reference = await cold.prefill(second, session_id="b")
    assert min(restored(result)) > 0
    assert joined_in == [False, False]  # one join per stage, each in a worker thread
    np.testing.assert_allclose(result.frame.rows(), reference.frame.rows(), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("index", ["ladder", "paged"])
async def test_salted_tenants_do_not_share_in_a_pipeline(index: str) -> None:
    """The same prompt under another salt restores nothing; under the same salt, everything."""
    configs = stage_configs(2, max_entries=64)
    if index == "paged":
        configs = paged(configs)
    tokens = prompt(512)
    async with open_pipeline(configs, mix_factory(width=4), environ=NO_ENV) as pipeline:
        await pipeline.prefill(tokens, session_id="a", cache_salt="tenant-a")
        other = await pipeline.prefill(tokens, session_id="b", cache_salt="tenant-b")
        unsalted = await pipeline.prefill(tokens, session_id="c")
        same = await pipeline.prefill(tokens, session_id="d", cache_salt="tenant-a")
        with pytest.raises(ConfigError, match=r"non-empty string or None, got 3$"):
            await pipeline.prefill(tokens, session_id="e", cache_salt=3)  # type: ignore[arg-type]
    assert restored(other) == [0, 0]
    assert restored(unsalted) == [0, 0]
    assert restored(same) == [512, 512]


@st.composite
def workloads(draw: st.DrawFn) -> tuple[list[StageConfig], list[np.ndarray[Any, Any]], bool]:
    """Prompts built from shared token blocks (so prefixes repeat), and paged cache settings."""
    blocks = draw(
        st.lists(st.lists(st.integers(0, 50_000), min_size=1, max_size=12), min_size=2, max_size=4)
    )
    chains: list[list[int]] = []
    for _ in range(draw(st.integers(1, 7))):
        base: list[int] = []
        if chains and draw(st.integers(0, 3)) > 0:
            earlier = draw(st.sampled_from(chains))
            base = earlier[: draw(st.integers(0, len(earlier)))]
        tail = draw(st.lists(st.integers(0, len(blocks) - 1), min_size=1, max_size=3))
        chains.append(base + tail)
    prompts = [np.array([t for b in chain for t in blocks[b]], dtype=np.int32) for chain in chains]
    row_bytes = 4 * 4  # width 4, float32
    configs = stage_configs(
        draw(st.integers(1, 3)),
        max_entries=draw(st.integers(1, 12)),
        max_bytes=draw(st.sampled_from([0, 0, row_bytes * 8, row_bytes * 40])),
        min_tokens=draw(st.integers(1, 8)),
        stride=draw(st.integers(0, 8)),
    )
    page_tokens = draw(st.one_of(st.none(), st.integers(1, 6)))
    return paged(configs, page_tokens), prompts, draw(st.booleans())


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(workload=workloads())
def test_paged_pipeline_equals_uncached_pipeline(
    workload: tuple[list[StageConfig], list[np.ndarray[Any, Any]], bool],
) -> None:
    """In paged mode too, outputs equal an uncached pipeline's for any prompts and bounds, and
    every stage computes exactly the tokens it did not restore."""
    configs, prompts, concurrent = workload
    factory = mix_factory(width=4)

    async def run() -> tuple[list[PrefillResult], list[PrefillResult]]:
        cached: dict[int, PrefillResult] = {}
        async with open_pipeline(configs, factory, environ=NO_ENV) as pipeline:
            if concurrent:
                async with trio.open_nursery() as nursery:
                    for i, tokens in enumerate(prompts):

                        async def one(i: int = i, tokens: Any = tokens) -> None:
                            cached[i] = await pipeline.prefill(tokens, session_id="s")

                        nursery.start_soon(one)
            else:
                for i, tokens in enumerate(prompts):
                    cached[i] = await pipeline.prefill(tokens, session_id="s")
        async with open_pipeline(uncached(configs), factory, environ=NO_ENV) as cold:
            reference = [await cold.prefill(tokens, session_id="s") for tokens in prompts]
        return [cached[i] for i in range(len(prompts))], reference

    with capture_actor_logs():
        cached, reference = trio.run(run)
    for got, want in zip(cached, reference, strict=True):
        np.testing.assert_allclose(got.frame.rows(), want.frame.rows(), rtol=1e-6, atol=1e-6)
        for report in got.stages:
            assert 0 <= report.restored_tokens <= got.tokens
            assert report.computed_tokens == got.tokens - report.restored_tokens


async def test_each_evicted_page_is_an_activation_evicted_event(logs: list[LogEvent]) -> None:
    """Under a tight entry bound, every page the index evicts is logged like a ladder eviction."""
    configs = paged(stage_configs(1, max_entries=3))
    async with open_pipeline(configs, mix_factory(width=4), environ=NO_ENV) as pipeline:
        first = await pipeline.prefill(prompt(384), session_id="a")  # pages 0..2
        second = await pipeline.prefill(prompt(256, start=5_000), session_id="b")
    evicted = [e for report in second.stages for e in report.evicted]
    assert first.stages[0].evicted == ()
    assert [(e.token_count, e.reason) for e in evicted] == [(128, "max_entries")] * 2
    events = events_named(logs, "activation_evicted")
    assert [(e["token_count"], e["reason"]) for e in events] == [(128, "max_entries")] * 2
    assert all(":page:" in e["page_id"] for e in events)


@pytest.mark.parametrize("index", ["ladder", "paged"])
async def test_pipeline_stats_carry_each_stages_accounting(
    logs: list[LogEvent], index: str
) -> None:
    """pipeline.statistics() gives every stage's misses by reason, restored tokens and footprint."""
    configs = stage_configs(2, max_entries=64)
    if index == "paged":
        configs = paged(configs)
    first = prompt(600)
    async with open_pipeline(configs, mix_factory(width=4), environ=NO_ENV) as pipeline:
        await pipeline.prefill(first, session_id="a")
        await pipeline.prefill(first, session_id="b")
        live = await pipeline.statistics()
    final = await pipeline.statistics()  # after the pipeline stopped: the stages' last stats
    for stats in (live, final):
        assert [stage.stage_id for stage in stats.stages] == ["stage-0", "stage-1"]
        for stage in stats.stages:
            acc = stage.accounting
            assert acc is not None
            assert stage.cache is not None
            assert acc is stage.cache.accounting
            assert acc.index == index
            assert (acc.lookups, acc.hits, acc.restored_tokens) == (2, 1, 600)
            assert (acc.misses_never_seen, acc.misses_evicted, acc.misses_rejected) == (1, 0, 0)
            assert acc.resident_bytes == stage.cache.resident_bytes
            assert acc.unique_prefix_bytes == 600 * 4 * 4  # 600 rows of 4 float32
    missed = events_named(logs, "activation_missed")
    assert [(e["stage"], e["reason"]) for e in missed] == [
        ("stage-0", "never_seen"),
        ("stage-1", "never_seen"),
    ]
