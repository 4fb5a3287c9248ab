"""Tests of pipelines: seed scenarios end to end, concurrency, failures, cancellation, drain."""

from __future__ import annotations

import functools
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import attrs
import numpy as np
import numpy.typing as npt
import pytest
import trio
import trio.testing
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from actors.testing import LogEvent, capture_actor_logs, events_named
from stage_runtime.cache_actor import CacheActor
from stage_runtime.config import CacheMode, StageConfig
from stage_runtime.errors import (
    ConfigError,
    FrameError,
    PipelineStoppedError,
    StageFailedError,
)
from stage_runtime.frames import ActivationFrame
from stage_runtime.models import StageModel, reference_model_factory, virtual_model_factory
from stage_runtime.pipeline import PrefillResult, load_topology, open_pipeline
from tests.stage_runtime.pipeline_helpers import (
    ForwardingModel,
    ModelRegistry,
    WrappedModel,
    mix_factory,
    prompt,
    stage_configs,
    uncached,
)

NO_ENV: dict[str, str] = {}


@pytest.fixture(autouse=True)
def logs() -> Iterator[list[LogEvent]]:
    """Capture every log event (keeps the output quiet; tests inspect them)."""
    with capture_actor_logs() as captured:
        yield captured


def restored(result: PrefillResult) -> list[int]:
    return [report.restored_tokens for report in result.stages]


def computed(result: PrefillResult) -> list[int]:
    return [report.computed_tokens for report in result.stages]


async def test_seed_prompt_records_2214_and_2176_at_every_stage() -> None:
    """A cold 2214-token prefill computes everything and records [2214, 2176] per stage."""
    async with open_pipeline(stage_configs(3), mix_factory(), environ=NO_ENV) as pipeline:
        result = await pipeline.prefill(prompt(2214), session_id="s")
    assert result.tokens == 2214
    assert result.frame.token_count == 2214
    assert [r.stage_id for r in result.stages] == ["stage-0", "stage-1", "stage-2"]
    assert restored(result) == [0, 0, 0]
    assert computed(result) == [2214, 2214, 2214]
    for report in result.stages:
        assert [record.token_count for record in report.records] == [2214, 2176]
        assert report.evicted == ()


async def test_extended_prompt_restores_2176_at_every_stage_and_matches_uncached() -> None:
    """The 2231-token extension restores 2176 tokens per stage; its output equals a cold run."""
    extended = np.concatenate([prompt(2214), prompt(17, start=100_000)])
    registry = ModelRegistry(mix_factory())
    async with open_pipeline(stage_configs(3), registry, environ=NO_ENV) as pipeline:
        await pipeline.prefill(prompt(2214), session_id="s")
        result = await pipeline.prefill(extended, session_id="other-session")
    # each model really computed only the 55 tokens after the restored prefix
    assert [m.calls for m in registry.models.values()] == [[(0, 2214), (2176, 2231)]] * 3
    async with open_pipeline(uncached(stage_configs(3)), mix_factory(), environ=NO_ENV) as cold:
        reference = await cold.prefill(extended, session_id="s")
    assert restored(result) == [2176, 2176, 2176]
    assert computed(result) == [55, 55, 55]
    assert restored(reference) == [0, 0, 0]
    np.testing.assert_allclose(result.frame.rows(), reference.frame.rows(), rtol=1e-6, atol=1e-6)


async def test_width_mismatch_misses_at_every_stage() -> None:
    """Models swapped for wider ones never restore what the old width recorded."""
    registry = ModelRegistry(mix_factory())
    configs = stage_configs(2)
    async with open_pipeline(configs, registry, environ=NO_ENV) as pipeline:
        await pipeline.prefill(prompt(300), session_id="s")
        assert restored(await pipeline.prefill(prompt(300), session_id="s")) == [300, 300]
        for config in configs:
            registry.models[config.stage_id].inner = mix_factory(width=16)(config)
        result = await pipeline.prefill(prompt(300), session_id="s")
    assert restored(result) == [0, 0]
    assert computed(result) == [300, 300]
    assert result.frame.rows().shape == (300, 16)


async def test_full_hit_skips_the_model(logs: list[LogEvent]) -> None:
    """A prompt cached at its exact length is restored whole; the model is not called."""
    registry = ModelRegistry(mix_factory())
    async with open_pipeline(stage_configs(2), registry, environ=NO_ENV) as pipeline:
        first = await pipeline.prefill(prompt(300), session_id="s")
        second = await pipeline.prefill(prompt(300), session_id="s")
    assert computed(second) == [0, 0]
    assert [len(model.calls) for model in registry.models.values()] == [1, 1]
    np.testing.assert_array_equal(first.frame.rows(), second.frame.rows())
    hits = events_named(logs, "activation_restored")
    assert [(e["stage"], e["decision"]) for e in hits] == [
        ("stage-0", "activation_resident_hit"),
        ("stage-1", "activation_resident_hit"),
    ]


async def test_cache_events_name_the_request_that_caused_them(logs: list[LogEvent]) -> None:
    """Restores, misses, records and the evictions a record caused carry the request's id, so
    that under concurrent traffic a tenant's miss can be matched to its request."""
    configs = stage_configs(1, min_tokens=8, max_entries=2)
    async with open_pipeline(configs, mix_factory(), environ=NO_ENV) as pipeline:
        await pipeline.prefill(prompt(50), session_id="s", request_id="first")
        await pipeline.prefill(prompt(50, start=500), session_id="s", request_id="second")
        await pipeline.prefill(prompt(50), session_id="s", request_id="third")
    by_event = {
        name: [e.get("request_id") for e in events_named(logs, name)]
        for name in ("activation_missed", "activation_recorded", "activation_evicted")
    }
    assert by_event["activation_missed"] == ["first", "second", "third"]
    assert set(by_event["activation_recorded"]) == {"first", "second", "third"}
    assert by_event["activation_evicted"]  # the second prompt's records evicted the first's
    assert set(by_event["activation_evicted"]) <= {"second", "third"}


async def test_events_carry_the_stage_that_emitted_them(logs: list[LogEvent]) -> None:
    """Every cache event is tagged with its stage through contextvars."""
    async with open_pipeline(stage_configs(2), mix_factory(), environ=NO_ENV) as pipeline:
        await pipeline.prefill(prompt(300), session_id="s")
    recorded = events_named(logs, "activation_recorded")
    assert [(e["stage"], e["token_count"]) for e in recorded] == [
        ("stage-0", 300),
        ("stage-0", 256),
        ("stage-1", 300),
        ("stage-1", 256),
    ]
    assert {e["stage"] for e in events_named(logs, "stage_started")} == {"stage-0", "stage-1"}


async def test_eviction_reports_with_max_entries_1(logs: list[LogEvent]) -> None:
    """With one entry per stage, each prefill's second rung evicts its first, per stage."""
    configs = stage_configs(2, max_entries=1)
    async with open_pipeline(configs, mix_factory(), environ=NO_ENV) as pipeline:
        result = await pipeline.prefill(prompt(2214), session_id="s")
    for report in result.stages:
        assert [(e.token_count, e.reason) for e in report.evicted] == [(2214, "max_entries")]
    evicted = events_named(logs, "activation_evicted")
    assert [(e["stage"], e["token_count"], e["entries"]) for e in evicted] == [
        ("stage-0", 2214, 0),
        ("stage-1", 2214, 0),
    ]


async def test_concurrent_prefills_overlap_across_stages(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Ten 1-second-per-stage requests through 2 stages take 11 s, not 20 s."""
    factory = virtual_model_factory(width=4, seconds_per_token=0.01)
    results: list[PrefillResult] = []

    async def one(pipeline: Any, i: int) -> None:
        results.append(await pipeline.prefill(prompt(100, start=1000 * i), session_id=f"s{i}"))

    async with open_pipeline(stage_configs(2, min_tokens=0), factory, environ=NO_ENV) as pipeline:
        start = trio.current_time()
        async with trio.open_nursery() as nursery:
            for i in range(10):
                nursery.start_soon(one, pipeline, i)
        elapsed = trio.current_time() - start
    assert elapsed == pytest.approx(11.0)
    assert len(results) == 10
    # stage 0 finished request i at i + 1 s; stage 1 started it then and took 1 s
    by_id = {result.request_id: result for result in results}
    for i in range(10):
        s0, s1 = by_id[f"prefill-{i}"].stages
        assert (s0.finished_s - start, s1.started_s - start) == pytest.approx((i + 1, i + 1))
        assert s1.finished_s - s1.started_s == pytest.approx(1.0)
    assert all(result.frame.is_virtual for result in results)
    assert {result.request_id for result in results} == {f"prefill-{i}" for i in range(10)}


async def _concurrent_prefills(
    configs: list[StageConfig], count: int, *, channel_size: int
) -> list[PrefillResult]:
    """``count`` prefills of different prompts started at once; each result is checked to be
    its own prompt's output (a cold pipeline's, within float tolerance)."""
    prompts = [prompt(40 + 7 * i, start=3 * i) for i in range(count)]
    outputs: dict[int, PrefillResult] = {}

    async def one(pipeline: Any, i: int) -> None:
        outputs[i] = await pipeline.prefill(prompts[i], session_id="s", request_id=f"r{i}")

    async with (
        open_pipeline(configs, mix_factory(), channel_size=channel_size, environ=NO_ENV) as pipe,
        trio.open_nursery() as nursery,
    ):
        for i in range(count):
            nursery.start_soon(one, pipe, i)
    async with open_pipeline(uncached(configs), mix_factory(), environ=NO_ENV) as cold:
        for i, tokens in enumerate(prompts):
            reference = await cold.prefill(tokens, session_id="s")
            assert outputs[i].request_id == f"r{i}"
            np.testing.assert_allclose(
                outputs[i].frame.rows(), reference.frame.rows(), rtol=1e-6, atol=1e-6
            )
    return [outputs[i] for i in range(count)]


async def test_results_route_back_to_their_callers() -> None:
    """Many concurrent prefills each get the output of their own prompt."""
    configs = stage_configs(2, min_tokens=8, stride=8, max_entries=4)
    await _concurrent_prefills(configs, 12, channel_size=1)


async def test_a_stage_waits_to_queue_its_record_when_the_mailbox_is_full(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A stage queues its record at once when its cache actor's mailbox has room; when it has
    none (here: always) it waits in ``ask_later`` instead. Every prefill still gets its own
    output, and every stage's records reach its report."""
    from actors import ActorRef

    def full(self: Any, message: Any) -> Any:
        raise trio.WouldBlock

    waited = 0
    ask_later = ActorRef.ask_later

    async def counting(self: Any, message: Any) -> Any:
        nonlocal waited
        waited += 1
        return await ask_later(self, message)

    monkeypatch.setattr(ActorRef, "ask_later_nowait", full)
    monkeypatch.setattr(ActorRef, "ask_later", counting)
    configs = stage_configs(3, min_tokens=8, stride=8, max_entries=64)
    results = await _concurrent_prefills(configs, 6, channel_size=0)
    assert waited == 3 * len(results)  # every stage, every prompt
    assert all(stage.records for result in results for stage in result.stages)


async def test_bounded_channels_push_back_on_callers() -> None:
    """With a blocked last stage, stage 0 runs ahead only as far as the channels hold."""
    registry = ModelRegistry(mix_factory())
    async with (
        open_pipeline(stage_configs(2), registry, channel_size=1, environ=NO_ENV) as pipeline,
        trio.open_nursery() as nursery,
    ):
        gate = trio.Event()
        registry.models["stage-1"].gate = gate

        async def one(i: int) -> None:
            await pipeline.prefill(prompt(10, 100 * i), session_id="s")

        for i in range(8):
            nursery.start_soon(one, i)
        await trio.testing.wait_all_tasks_blocked()
        # stage 1 computes one, one waits in its inbox, stage 0 holds one it cannot send,
        # and one waits in stage 0's inbox: the other four callers wait to send.
        assert len(registry.models["stage-1"].calls) == 1
        assert len(registry.models["stage-0"].calls) == 3
        gate.set()
    assert len(registry.models["stage-1"].calls) == 8


async def test_prompts_longer_than_the_stages_context_are_refused() -> None:
    """The smallest ctx_size bounds a prompt, as the HTTP server does; nothing enters."""
    configs = stage_configs(2)
    configs[1] = attrs.evolve(configs[1], ctx_size=500)
    async with open_pipeline(configs, mix_factory(), environ=NO_ENV) as pipeline:
        assert pipeline.max_prompt_tokens == 500
        with pytest.raises(
            ConfigError,
            match=r"^tokens must be at most the stages' context \(500 tokens, the smallest "
            r"ctx_size\), got 501$",
        ):
            await pipeline.prefill(prompt(501), session_id="s")
        result = await pipeline.prefill(prompt(500), session_id="s")
        stats = await pipeline.statistics()
    assert computed(result) == [500, 500]
    assert [s.cache.records if s.cache else None for s in stats.stages] == [2, 2]


@pytest.mark.parametrize("field", ["cache_salt", "session_id", "request_id"])
async def test_text_that_is_not_unicode_is_refused_before_it_reaches_a_stage(field: str) -> None:
    """A lone surrogate in the salt crashed a stage when it hashed it (a 65-token prompt through
    the HTTP server took the server down); it is this caller's ConfigError now."""
    kwargs: dict[str, Any] = {"session_id": "s", field: "tenant-\udfff"}
    async with open_pipeline(stage_configs(2), mix_factory(), environ=NO_ENV) as pipeline:
        with pytest.raises(ConfigError, match=f"^{field} must be valid UTF-8 text, got a lone"):
            await pipeline.prefill(prompt(300), **kwargs)
        result = await pipeline.prefill(prompt(300), session_id="s", cache_salt="tenant")
    assert computed(result) == [300, 300]


@pytest.mark.parametrize("field", ["cache_salt", "session_id", "request_id"])
@pytest.mark.parametrize("control", ["\x1b", "\n", "\x00", "\x7f", "\x85", "\x9b"])
async def test_ids_holding_control_characters_are_refused(field: str, control: str) -> None:
    """C0 controls, DEL and C1 controls in an id would reach the console log raw (a terminal
    escape); the caller gets a ConfigError naming the field, the character and its index."""
    kwargs: dict[str, Any] = {"session_id": "s", field: f"id{control}x"}
    async with open_pipeline(stage_configs(2), mix_factory(), environ=NO_ENV) as pipeline:
        expected = f"{field} must not hold control characters, got {control!r} at index 2"
        with pytest.raises(ConfigError, match=f"^{re.escape(expected)}$"):
            await pipeline.prefill(prompt(300), **kwargs)
        result = await pipeline.prefill(prompt(300), session_id="s", request_id="é ü")
    assert computed(result) == [300, 300]


async def test_an_empty_session_id_is_refused_as_over_http() -> None:
    """HTTP refuses ``"session_id": ""``; the Python API accepted it."""
    async with open_pipeline(stage_configs(2), mix_factory(), environ=NO_ENV) as pipeline:
        with pytest.raises(ConfigError, match=r"^session_id must be a non-empty string, got ''$"):
            await pipeline.prefill(prompt(300), session_id="")
        with pytest.raises(ConfigError, match=r"^request_id must be a non-empty string or None"):
            await pipeline.prefill(prompt(300), session_id="s", request_id="")
        result = await pipeline.prefill(prompt(300), session_id="s")
    assert computed(result) == [300, 300]


async def test_bad_tokens_fail_only_that_caller() -> None:
    """Bad prompts raise ConfigError at once; the pipeline keeps serving."""
    async with open_pipeline(stage_configs(2), mix_factory(), environ=NO_ENV) as pipeline:
        with pytest.raises(ConfigError, match="non-empty"):
            await pipeline.prefill([], session_id="s")
        with pytest.raises(ConfigError, match="tokens must be integers"):
            await pipeline.prefill(["a", "b"], session_id="s")  # type: ignore[list-item]
        with pytest.raises(ConfigError, match="tokens must be a sequence of integers, got None"):
            await pipeline.prefill(None, session_id="s")  # type: ignore[arg-type]
        with pytest.raises(ConfigError, match="int32 range"):
            await pipeline.prefill(np.array([1, 2**40]), session_id="s")
        with pytest.raises(ConfigError, match="session_id must be a non-empty string, got 7"):
            await pipeline.prefill([1, 2], session_id=7)  # type: ignore[arg-type]
        with pytest.raises(
            ConfigError, match="request_id must be a non-empty string or None, got 5"
        ):
            await pipeline.prefill([1, 2], session_id="s", request_id=5)  # type: ignore[arg-type]
        with pytest.raises(ConfigError, match="cache_salt must be a non-empty string or None"):
            await pipeline.prefill([1, 2], session_id="s", cache_salt="")  # the server's rule
        result = await pipeline.prefill([1, 2, 3], session_id="s")
        stats = await pipeline.statistics()
    assert result.tokens == 3
    # none of the refused prompts reached a stage: one restore per stage, for the good one
    assert [s.cache.accounting.lookups if s.cache else None for s in stats.stages] == [1, 1]


async def test_model_error_fails_only_that_request(logs: list[LogEvent]) -> None:
    """A model that fails on one input fails that caller; concurrent callers succeed."""
    registry = ModelRegistry(mix_factory())
    outcomes: dict[int, object] = {}

    async def one(pipeline: Any, i: int) -> None:
        try:
            outcomes[i] = await pipeline.prefill(prompt(20, start=i), session_id="s")
        except ValueError as exc:
            outcomes[i] = exc

    configs = stage_configs(2, min_tokens=8)
    async with open_pipeline(configs, registry, environ=NO_ENV) as pipeline:
        registry.models["stage-0"].fail_on_token = 24  # in prompts starting at 5..24
        async with trio.open_nursery() as nursery:
            for i in (0, 4, 5, 30):
                nursery.start_soon(one, pipeline, i)
        stats = await pipeline.statistics()
    (failed,) = events_named(logs, "prefill_failed")
    assert (failed["stage"], failed["error_type"]) == ("stage-0", "ValueError")
    assert isinstance(outcomes[5], ValueError)
    assert "token 24" in str(outcomes[5])
    assert all(isinstance(outcomes[i], PrefillResult) for i in (0, 4, 30))
    # the failed request reached neither cache
    assert [s.cache.records if s.cache else None for s in stats.stages] == [6, 6]


@attrs.define(eq=False)
class NarrowOnceModel(WrappedModel):
    """Reference rows, except that the first forward returns only the first half of each row."""

    narrowed: bool = False

    async def forward(
        self, inputs: ActivationFrame, start: int, restored: ActivationFrame | None
    ) -> ActivationFrame:
        """The wrapped model's rows, cut to half width the first time."""
        out = await self.inner.forward(inputs, start, restored)
        if self.narrowed:
            return out
        self.narrowed = True
        half = out.rows()[:, : self.activation_width // 2]
        return ActivationFrame.from_array(np.ascontiguousarray(half))


async def test_output_rows_of_another_width_fail_the_request_and_are_not_recorded() -> None:
    """Rows narrower than activation_width would be cached under its key and restored into
    later prompts: the request fails with FrameError, nothing is recorded, and later prompts
    extending it compute correctly."""
    reference = mix_factory()

    def factory(config: StageConfig) -> StageModel:
        return NarrowOnceModel(reference(config))

    configs = stage_configs(1, min_tokens=8, stride=8)
    async with open_pipeline(configs, factory, environ=NO_ENV) as pipeline:
        with pytest.raises(
            FrameError,
            match=r"^model output rows must be activation_width 8 F32 values wide, got 4$",
        ):
            await pipeline.prefill(prompt(20), session_id="s")
        stats = await pipeline.statistics()
        assert stats.stages[0].cache is not None
        assert stats.stages[0].cache.entries == 0
        first = await pipeline.prefill(prompt(20), session_id="s")
        second = await pipeline.prefill(prompt(30), session_id="s")
    assert restored(first) == [0]
    assert restored(second) == [16]
    async with open_pipeline(uncached(configs), mix_factory(), environ=NO_ENV) as cold:
        expected = await cold.prefill(prompt(30), session_id="s")
    np.testing.assert_allclose(second.frame.rows(), expected.frame.rows(), rtol=1e-6, atol=1e-6)


@attrs.define(eq=False)
class FullRestoreModel(WrappedModel):
    """Counts the whole-prompt restores it is told of; raises on them when ``fail`` is set."""

    restores: list[int] = attrs.field(factory=list)
    fail: bool = False

    async def full_restore(self, restored: ActivationFrame) -> None:
        """Record the restored length (or fail on it)."""
        if self.fail:
            raise RuntimeError("cannot load the restored activations")
        self.restores.append(restored.token_count)


async def test_a_whole_prompt_restore_calls_the_models_optional_full_restore() -> None:
    """No forward runs for a whole-prompt hit; a model's full_restore hears of it, and its
    error fails that request only."""
    models: dict[str, FullRestoreModel] = {}
    reference = mix_factory()

    def factory(config: StageConfig) -> StageModel:
        models[config.stage_id] = FullRestoreModel(reference(config))
        return models[config.stage_id]

    configs = stage_configs(2, min_tokens=8, stride=8)
    async with open_pipeline(configs, factory, environ=NO_ENV) as pipeline:
        await pipeline.prefill(prompt(24), session_id="s")
        again = await pipeline.prefill(prompt(24), session_id="s")
        assert [m.restores for m in models.values()] == [[24], [24]]
        models["stage-1"].fail = True
        with pytest.raises(RuntimeError, match="cannot load the restored activations"):
            await pipeline.prefill(prompt(24), session_id="s")
        models["stage-1"].fail = False
        after = await pipeline.prefill(prompt(24), session_id="s")
    assert restored(again) == restored(after) == [24, 24]
    assert computed(again) == [0, 0]


@attrs.define(eq=False)
class AsyncEmbedModel(WrappedModel):
    """Embeds only through embed_async, counting the calls."""

    calls: list[int] = attrs.field(factory=list)

    def embed(self, tokens: npt.NDArray[np.int32]) -> ActivationFrame:
        """Never used by a stage when embed_async exists."""
        raise AssertionError("the stage should await embed_async")

    async def embed_async(self, tokens: npt.NDArray[np.int32]) -> ActivationFrame:
        """Embed with the wrapped model, counting the tokens."""
        self.calls.append(int(tokens.size))
        return self.inner.embed(tokens)


async def test_stage_zero_awaits_a_models_embed_async_when_it_has_one() -> None:
    """embed_async lets a model embed off the event loop; the stage prefers it to embed."""
    models: dict[str, AsyncEmbedModel] = {}
    reference = mix_factory()

    def factory(config: StageConfig) -> StageModel:
        models[config.stage_id] = AsyncEmbedModel(reference(config))
        return models[config.stage_id]

    async with open_pipeline(stage_configs(2), factory, environ=NO_ENV) as pipeline:
        await pipeline.prefill(prompt(20), session_id="s")
    assert models["stage-0"].calls == [20]
    assert models["stage-1"].calls == []  # stage 1 gets stage 0's frame


async def test_numpy_integer_activation_width_is_accepted() -> None:
    """A model whose activation_width is a numpy integer caches like one with an int."""
    configs = stage_configs(2, min_tokens=8, stride=8)
    factory = reference_model_factory(width=np.int64(8))  # type: ignore[arg-type]
    async with open_pipeline(configs, factory, environ=NO_ENV) as pipeline:
        await pipeline.prefill(prompt(20), session_id="s")
        again = await pipeline.prefill(prompt(30), session_id="s")
    assert restored(again) == [16, 16]


async def test_cancelled_caller_leaves_no_partial_state(
    autojump_clock: trio.testing.MockClock, logs: list[LogEvent]
) -> None:
    """Cancelling a prefill while stage 1 computes: stage 1 stops and records nothing."""
    factory = virtual_model_factory(width=4, seconds_per_token=0.01)
    async with open_pipeline(stage_configs(2, min_tokens=8), factory, environ=NO_ENV) as pipeline:
        with trio.move_on_after(1.5) as scope:  # stage 0 takes 1 s, stage 1 would take 1 s more
            await pipeline.prefill(prompt(100), session_id="s")
        assert scope.cancelled_caught
        await trio.testing.wait_all_tasks_blocked()
        stats = await pipeline.statistics()
        assert [s.cache.entries if s.cache else None for s in stats.stages] == [2, 0]
        # the next caller sees stage 0's complete records and recomputes stage 1 from scratch
        start = trio.current_time()
        result = await pipeline.prefill(prompt(100), session_id="s")
        assert trio.current_time() - start == pytest.approx(1.0)
    assert restored(result) == [100, 0]
    stopped = {e["stage"]: e for e in events_named(logs, "stage_stopped")}
    assert (stopped["stage-1"]["completed"], stopped["stage-1"]["skipped"]) == (1, 1)
    assert (stopped["stage-0"]["completed"], stopped["stage-0"]["skipped"]) == (2, 0)


@attrs.define(eq=False)
class InterruptibleModel(WrappedModel):
    """Takes ``seconds`` on 77-token prompts; when cancelled then, it raises an ordinary error
    (as an interrupted device or RPC call might). With ``shards`` the work runs in the model's
    own nursery, which then raises a group of that error and a Cancelled."""

    shards: bool = False
    seconds: float = 10.0
    interrupted: int = 0

    async def forward(
        self, inputs: ActivationFrame, start: int, restored: ActivationFrame | None
    ) -> ActivationFrame:
        if inputs.token_count == 77 and self.seconds:
            if self.shards:
                async with trio.open_nursery() as nursery:
                    for i in range(2):
                        nursery.start_soon(self._work, i)
            else:
                await self._work(0)
        return await self.inner.forward(inputs, start, restored)

    async def _work(self, shard: int) -> None:
        try:
            await trio.sleep(self.seconds)
        except trio.Cancelled:
            if shard == 0:
                self.interrupted += 1
                raise RuntimeError("shard 0: transfer interrupted") from None
            raise


@pytest.mark.parametrize("shards", [False, True])
async def test_a_model_error_raised_by_cancellation_fails_only_that_caller(
    autojump_clock: trio.testing.MockClock, logs: list[LogEvent], shards: bool
) -> None:
    """Cancelling a caller whose stage model raises an error when cancelled (alone, or grouped
    with the Cancelled by the model's own nursery): the abandoned request is skipped, not a
    failure; another caller's prefill completes and the pipeline keeps serving."""
    models: dict[str, InterruptibleModel] = {}

    def factory(config: StageConfig) -> StageModel:
        inner = virtual_model_factory(width=4, seconds_per_token=0.01)(config)
        models[config.stage_id] = InterruptibleModel(
            inner, shards=shards, seconds=10.0 if config.stage_index == 1 else 0.0
        )
        return models[config.stage_id]

    others: list[PrefillResult] = []

    async def other(pipeline: Any) -> None:
        others.append(await pipeline.prefill(prompt(64, start=500), session_id="other"))

    async with open_pipeline(stage_configs(2, min_tokens=8), factory, environ=NO_ENV) as pipeline:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(other, pipeline)
            with trio.move_on_after(2.0) as scope:  # stage 1 is in the model's wait by then
                await pipeline.prefill(prompt(77), session_id="slow")
            assert scope.cancelled_caught
        assert models["stage-1"].interrupted == 1
        assert restored(others[0]) == [0, 0]
        after = await pipeline.prefill(prompt(90), session_id="later")
        assert restored(after) == [72, 0]
    stopped = {e["stage"]: e for e in events_named(logs, "stage_stopped")}
    assert (stopped["stage-1"]["completed"], stopped["stage-1"]["skipped"]) == (2, 1)
    assert stopped["stage-1"]["failed"] == 0
    assert not events_named(logs, "prefill_failed")


@pytest.mark.parametrize("shards", [False, True])
async def test_a_model_interrupted_by_the_pipeline_stopping_is_not_the_requests_failure(
    autojump_clock: trio.testing.MockClock, logs: list[LogEvent], shards: bool
) -> None:
    """The pipeline's block is cancelled while stage 1's model computes; the model raises when
    interrupted. Its caller (in another task) learns that the pipeline stopped, not that the
    model failed on its prompt."""
    outcome: list[BaseException] = []

    def factory(config: StageConfig) -> StageModel:
        inner = virtual_model_factory(width=4, seconds_per_token=0.01)(config)
        seconds = 10.0 if config.stage_index == 1 else 0.0
        return InterruptibleModel(inner, shards=shards, seconds=seconds)

    async def caller(pipeline: Any, task_status: trio.TaskStatus[None]) -> None:
        task_status.started()
        try:
            await pipeline.prefill(prompt(77), session_id="s")
        except Exception as exc:
            outcome.append(exc)

    async with trio.open_nursery() as callers:
        with trio.move_on_after(2.0):  # stage 1 is in the model's wait by then
            async with open_pipeline(stage_configs(2, min_tokens=8), factory, environ=NO_ENV) as p:
                await callers.start(caller, p)
                await trio.sleep_forever()
    assert [type(error) for error in outcome] == [PipelineStoppedError]
    assert not events_named(logs, "prefill_failed")
    [interrupted] = events_named(logs, "prefill_interrupted")
    assert interrupted["error"] == "shard 0: transfer interrupted"


@attrs.define(eq=False)
class HoardingModel(WrappedModel):
    """Keeps the Cancelled of an abandoned 77-token prompt and raises it on a 33-token one."""

    kept: list[trio.Cancelled] = attrs.field(factory=list)

    async def forward(
        self, inputs: ActivationFrame, start: int, restored: ActivationFrame | None
    ) -> ActivationFrame:
        if inputs.token_count == 77:
            try:
                await trio.sleep(10)
            except trio.Cancelled as cancelled:
                self.kept.append(cancelled)
                raise
        if inputs.token_count == 33:
            raise self.kept[0]
        return await self.inner.forward(inputs, start, restored)


async def test_a_stray_cancelled_from_a_model_fails_that_request_and_names_the_bug(
    autojump_clock: trio.testing.MockClock, logs: list[LogEvent]
) -> None:
    """A model raising a Cancelled kept from an earlier cancellation used to end its stage task
    silently (the next stage was blamed). It is that request's model error now."""

    def factory(config: StageConfig) -> StageModel:
        inner = virtual_model_factory(width=4, seconds_per_token=0.01)(config)
        return HoardingModel(inner) if config.stage_index == 1 else WrappedModel(inner)

    async with open_pipeline(stage_configs(2, min_tokens=8), factory, environ=NO_ENV) as pipeline:
        with trio.move_on_after(2.0):
            await pipeline.prefill(prompt(77), session_id="s")
        with pytest.raises(RuntimeError, match=r"raised trio\.Cancelled while nothing around it"):
            await pipeline.prefill(prompt(33, start=500), session_id="s")
        after = await pipeline.prefill(prompt(20, start=900), session_id="s")
    assert restored(after) == [0, 0]
    [failed] = events_named(logs, "prefill_failed")
    assert failed["error_type"] == "RuntimeError"


async def test_caller_cancelled_while_waiting_to_enter_never_reaches_a_stage(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """A caller held back by backpressure and cancelled before its request got in costs
    nothing: no stage sees it, and the pipeline still drains and stops."""
    registry = ModelRegistry(mix_factory())
    async with (
        open_pipeline(stage_configs(2), registry, channel_size=0, environ=NO_ENV) as pipeline,
        trio.open_nursery() as nursery,
    ):
        gate = trio.Event()
        registry.models["stage-0"].gate = gate
        nursery.start_soon(lambda: pipeline.prefill(prompt(10), session_id="a"))
        await trio.testing.wait_all_tasks_blocked()
        with trio.move_on_after(1) as scope:  # stage 0 is busy and the entry is a rendezvous
            await pipeline.prefill(prompt(10, start=50), session_id="b")
        assert scope.cancelled_caught
        gate.set()
    assert [m.calls for m in registry.models.values()] == [[(0, 10)], [(0, 10)]]
    stats = await pipeline.statistics()
    assert [s.cache.accounting.lookups if s.cache else None for s in stats.stages] == [1, 1]


async def test_request_cancelled_while_queued_is_skipped(
    autojump_clock: trio.testing.MockClock, logs: list[LogEvent]
) -> None:
    """A request whose caller gave up before stage 0 reached it is never computed."""
    registry = ModelRegistry(virtual_model_factory(width=4, seconds_per_token=0.01))
    async with open_pipeline(stage_configs(2), registry, environ=NO_ENV) as pipeline:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(lambda: pipeline.prefill(prompt(100), session_id="a"))
            await trio.testing.wait_all_tasks_blocked()
            with trio.move_on_after(0.5):
                await pipeline.prefill(prompt(100, start=500), session_id="b")
        assert [len(m.calls) for m in registry.models.values()] == [1, 1]
    stopped = {e["stage"]: e for e in events_named(logs, "stage_stopped")}
    assert (stopped["stage-0"]["completed"], stopped["stage-0"]["skipped"]) == (1, 1)
    assert (stopped["stage-1"]["completed"], stopped["stage-1"]["skipped"]) == (1, 0)


async def test_leaving_the_context_drains_in_flight_requests(
    autojump_clock: trio.testing.MockClock, logs: list[LogEvent]
) -> None:
    """Exiting waits for callers already in the pipeline, then refuses new ones."""
    factory = virtual_model_factory(width=4, seconds_per_token=0.01)
    finished: list[int] = []

    async def one(pipeline: Any, i: int) -> None:
        await pipeline.prefill(prompt(100, start=1000 * i), session_id="s")
        finished.append(i)

    async with trio.open_nursery() as callers:
        configs = stage_configs(2, min_tokens=8)
        async with open_pipeline(configs, factory, environ=NO_ENV) as pipeline:
            for i in range(5):
                callers.start_soon(one, pipeline, i)
            await trio.testing.wait_all_tasks_blocked()
            assert not pipeline.draining
        assert pipeline.draining
        assert sorted(finished) == [0, 1, 2, 3, 4]
        with pytest.raises(trio.ClosedResourceError, match="draining"):
            await pipeline.prefill(prompt(10), session_id="s")
    stats = await pipeline.statistics()  # the final statistics survive the stop
    assert [s.cache.records if s.cache else None for s in stats.stages] == [10, 10]
    assert all(s.mailbox.queued == 0 for s in stats.stages)
    # every stage served all five, then its cache actor drained and stopped
    stopped = [(e["stage"], e["completed"]) for e in events_named(logs, "stage_stopped")]
    assert sorted(stopped) == [("stage-0", 5), ("stage-1", 5)]
    actors = events_named(logs, "actor_stopped")
    assert sorted((e["actor"], e["drained"], e["dropped"]) for e in actors) == [
        ("cache-stage-0", True, 0),
        ("cache-stage-1", True, 0),
    ]


async def test_stage_crash_fails_the_pipeline_with_stage_failed_error() -> None:
    """A cache that raises (a bug) crashes its stage: StageFailedError chained to the cause."""

    def broken(self: CacheActor, *fields: Any) -> Any:
        raise RuntimeError("cache bug")

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(CacheActor, "_store", broken)
        with pytest.RaisesGroup(
            pytest.RaisesExc(StageFailedError, match="stage 'stage-0' failed")
        ) as group:
            async with open_pipeline(stage_configs(2), mix_factory(), environ=NO_ENV) as pipe:
                await pipe.prefill(prompt(10), session_id="s")
    error = group.value.exceptions[0]
    assert isinstance(error, StageFailedError)
    assert error.stage_id == "stage-0"
    assert isinstance(error.__cause__, RuntimeError)
    assert str(error.__cause__) == "cache bug"


async def test_stage_crash_fails_callers_outside_the_pipeline_block() -> None:
    """Callers waiting in other tasks get a PipelineStoppedError instead of hanging."""
    outcome: list[BaseException] = []

    def broken(self: CacheActor, *fields: Any) -> Any:
        raise RuntimeError("cache bug")

    async def caller(pipeline: Any, task_status: trio.TaskStatus[None]) -> None:
        task_status.started()
        try:
            await pipeline.prefill(prompt(10), session_id="s")
        except PipelineStoppedError as exc:
            outcome.append(exc)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(CacheActor, "_store", broken)
        async with trio.open_nursery() as callers:
            with pytest.RaisesGroup(StageFailedError):
                async with open_pipeline(stage_configs(2), mix_factory(), environ=NO_ENV) as pipe:
                    await callers.start(caller, pipe)
                    await trio.sleep_forever()
    assert len(outcome) == 1
    assert "pipeline stopped before request" in str(outcome[0])
    # A caller arriving afterwards hears that the pipeline failed, and why; not "draining".
    assert pipe.failure is not None
    assert pipe.failure.startswith("stage 'stage-0' failed")
    with pytest.raises(PipelineStoppedError, match=r"^pipeline stopped \(stage 'stage-0' failed"):
        await pipe.prefill(prompt(10), session_id="s")


async def test_a_normal_close_has_no_failure() -> None:
    async with open_pipeline(stage_configs(2), mix_factory(), environ=NO_ENV) as pipeline:
        await pipeline.prefill(prompt(10), session_id="s")
        assert pipeline.failure is None
    assert pipeline.failure is None
    with pytest.raises(trio.ClosedResourceError, match="draining"):
        await pipeline.prefill(prompt(10), session_id="s")


async def test_a_prefill_from_another_trio_run_is_refused_and_harms_nothing() -> None:
    """A worker thread calling trio.run(pipeline.prefill...) instead of trio.from_thread.run
    used to wedge stage 0 for good, or crash the last stage with a bare AssertionError. It is a
    RuntimeError in that caller, nothing is sent, and the pipeline keeps serving."""
    async with open_pipeline(stage_configs(2), mix_factory(), environ=NO_ENV) as pipeline:
        for call in (
            lambda: pipeline.prefill(prompt(10), session_id="t"),
            pipeline.statistics,
            pipeline.clear_caches,
        ):

            def in_another_run(call: Any = call) -> None:
                with pytest.raises(RuntimeError, match="trio run that opened it"):
                    trio.run(call)

            await trio.to_thread.run_sync(in_another_run)
        result = await pipeline.prefill(prompt(10), session_id="s")
        stats = await pipeline.statistics()
    assert result.tokens == 10
    assert [s.cache.accounting.lookups if s.cache else None for s in stats.stages] == [1, 1]


async def test_model_factory_failure_is_a_stage_failure() -> None:
    """A stage whose model cannot be built fails the pipeline at start."""

    def factory(config: Any) -> Any:
        if config.stage_index == 1:
            raise OSError("weights missing")
        return mix_factory()(config)

    with pytest.RaisesGroup(pytest.RaisesExc(StageFailedError, match="stage-1")) as group:
        async with open_pipeline(stage_configs(2), factory, environ=NO_ENV):
            pytest.fail("the pipeline must not start")
    assert isinstance(group.value.exceptions[0].__cause__, OSError)


@attrs.define(eq=False)
class _OddWidth(WrappedModel):
    """The wrapped model, claiming another activation_width."""

    width: Any = None

    @property
    def activation_width(self) -> int:
        return self.width  # type: ignore[no-any-return]


_NO_MODEL = (
    r"must be a StageModel \(with forward, and embed or embed_async\), got {} "
    r"\(no forward, no embed or embed_async\)"
)


@pytest.mark.parametrize(
    ("width", "built", "complaint"),
    [
        (None, None, _NO_MODEL.format("None")),
        (None, 42, _NO_MODEL.format("42")),
        (64.0, None, r"activation_width must be an integer >= 0, got 64\.0"),
        ("64", None, r"activation_width must be an integer >= 0, got '64'"),
        (-1, None, r"activation_width must be an integer >= 0, got -1"),
    ],
)
async def test_a_factory_whose_model_cannot_serve_fails_the_pipeline_at_start(
    width: object, built: object, complaint: str
) -> None:
    """What the factory returned is checked when the stage starts, not at the first prefill
    (a factory that forgot to return made every prefill a bare AssertionError)."""

    def factory(config: Any) -> Any:
        if config.stage_index != 0:
            return mix_factory()(config)
        if width is None:
            return built
        return _OddWidth(mix_factory()(config), width=width)

    with pytest.RaisesGroup(pytest.RaisesExc(StageFailedError, match="stage-0")) as group:
        async with open_pipeline(stage_configs(2), factory, environ=NO_ENV):
            pytest.fail("the pipeline must not start")
    cause = group.value.exceptions[0].__cause__
    assert isinstance(cause, ConfigError)
    assert str(cause).startswith("the model factory's model for stage 'stage-0'")
    assert re.search(complaint, str(cause)), str(cause)


async def test_a_bug_filing_a_records_report_crashes_the_stage_not_hangs(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """The cache actor hands a record's outcome to the stage as it replies; whatever goes wrong
    filing it (here a record that is not one) crashes the stage, as a failed record does: the
    caller's prefill is not left waiting."""

    def malformed(self: CacheActor, *fields: Any) -> Any:
        return [object()]

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(CacheActor, "_store", malformed)
        with trio.fail_after(60):  # virtual seconds: a hang fails here at once
            with pytest.RaisesGroup(
                pytest.RaisesExc(StageFailedError, match="stage 'stage-0' failed")
            ):
                async with open_pipeline(stage_configs(2), mix_factory(), environ=NO_ENV) as pipe:
                    await pipe.prefill(prompt(300), session_id="s")


async def test_a_stage_that_only_records_stays_one_record_ahead_of_its_actor(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """A stage that looks nothing up has no restore to queue behind its last record: it waits
    for each record, so its mailbox never holds a backlog of records and their frames, however
    many callers send prompts at once."""
    handle = CacheActor.handle

    async def slow(self: CacheActor, message: Any) -> Any:
        await trio.sleep(0.01)
        return handle(self, message)

    configs = stage_configs(1, mode=CacheMode.RECORD)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(CacheActor, "handle", slow)
        async with open_pipeline(configs, mix_factory(), environ=NO_ENV) as pipe:
            async with trio.open_nursery() as callers:
                for i in range(20):
                    callers.start_soon(
                        functools.partial(pipe.prefill, prompt(300, start=1000 * i), session_id="s")
                    )
            stats = await pipe.statistics()
    (stage,) = stats.stages
    assert stage.cache is not None
    assert stage.cache.records == 40  # every prompt recorded, two rungs each
    assert stage.mailbox.max_queued <= 1


@attrs.define(eq=False)
class _AsyncEmbedOnly(ForwardingModel):
    """The wrapped model, embedding through embed_async only."""

    async def embed_async(self, tokens: npt.NDArray[np.int32]) -> ActivationFrame:
        return self.inner.embed(tokens)


@pytest.mark.parametrize(
    ("stage_index", "wrapper"), [(0, _AsyncEmbedOnly), (1, ForwardingModel)], ids=["first", "later"]
)
async def test_a_stage_needs_only_what_it_calls(stage_index: int, wrapper: type[Any]) -> None:
    """Stage 0 embeds with embed_async when its model has one (no embed needed then); a later
    stage only forwards. Such models serve, and compute what the reference model does."""

    def factory(config: Any) -> Any:
        model = mix_factory()(config)
        return wrapper(model) if config.stage_index == stage_index else model

    async with open_pipeline(stage_configs(2), factory, environ=NO_ENV) as pipeline:
        result = await pipeline.prefill(prompt(10), session_id="s")
    async with open_pipeline(stage_configs(2), mix_factory(), environ=NO_ENV) as pipeline:
        expected = await pipeline.prefill(prompt(10), session_id="s")
    np.testing.assert_array_equal(result.frame.rows(), expected.frame.rows())


async def test_a_pipeline_cancelled_from_outside_says_so(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Cancelled from outside, every stage's task raises its own Cancelled: the failure is
    "cancelled", not the group they came in, and a later prefill says so."""
    with trio.move_on_after(1):
        async with open_pipeline(stage_configs(3), mix_factory(), environ=NO_ENV) as pipeline:
            await trio.sleep_forever()
    assert pipeline.failure == "cancelled"
    with pytest.raises(PipelineStoppedError, match=r"^pipeline stopped \(cancelled\)"):
        await pipeline.prefill(prompt(10), session_id="s")


async def test_stats_report_cache_and_mailbox_per_stage() -> None:
    """stats() gives each stage's cache counters and its cache actor's mailbox statistics."""
    async with open_pipeline(stage_configs(2), mix_factory(), environ=NO_ENV) as pipeline:
        await pipeline.prefill(prompt(300), session_id="s")
        await pipeline.prefill(prompt(300), session_id="s")
        stats = await pipeline.statistics()
    assert [s.stage_id for s in stats.stages] == ["stage-0", "stage-1"]
    for stage in stats.stages:
        assert stage.cache is not None
        assert (stage.cache.entries, stage.cache.hits, stage.cache.records) == (2, 1, 4)
        assert stage.mailbox.processed >= 4  # 2 restores + 2 records (+ stats asks)
        assert stage.mailbox.mailbox_size == 64


async def test_clear_caches_empties_every_stage(logs: list[LogEvent]) -> None:
    """clear_caches evicts every entry of every stage; the next prefill computes everything."""
    async with open_pipeline(stage_configs(2), mix_factory(), environ=NO_ENV) as pipeline:
        await pipeline.prefill(prompt(300), session_id="s")
        cleared = await pipeline.clear_caches()
        result = await pipeline.prefill(prompt(300), session_id="s")
    assert [sorted(e.token_count for e in stage) for stage in cleared] == [[256, 300]] * 2
    assert restored(result) == [0, 0]
    reasons = [e["reason"] for e in events_named(logs, "activation_evicted")]
    assert reasons == ["cleared"] * 4


async def test_virtual_frames_flow_through_without_memory() -> None:
    """Virtual frames stay virtual through restore, concat and record."""
    factory = virtual_model_factory(width=64, bytes_per_token=8192)
    configs = [attrs.evolve(config, ctx_size=65_536) for config in stage_configs(2)]
    async with open_pipeline(configs, factory, environ=NO_ENV) as pipeline:
        await pipeline.prefill(prompt(40_000), session_id="s")
        result = await pipeline.prefill(
            np.concatenate([prompt(40_000), prompt(100, 90_000)]), session_id="s"
        )
    assert restored(result) == [39_936, 39_936]
    assert result.frame.is_virtual
    assert result.frame.payload_bytes == 40_100 * 8192


async def test_topology_file_builds_a_pipeline(tmp_path: Path) -> None:
    """A TOML topology with defaults gives contiguous stages with neighbours filled in."""
    path = tmp_path / "topology.toml"
    path.write_text(
        """
[defaults]
model_id = "example/model"
[defaults.kv_cache]
mode = "lookup-record"
min_tokens = 8
[[stage]]
stage_id = "a"
layer_start = 0
layer_end = 3
[[stage]]
stage_id = "b"
layer_start = 3
layer_end = 6
[stage.kv_cache]
max_entries = 1
"""
    )
    configs = load_topology(path)
    assert [(c.stage_id, c.stage_index, c.upstream, c.downstream) for c in configs] == [
        ("a", 0, None, "b"),
        ("b", 1, "a", None),
    ]
    assert configs[1].kv_cache is not None
    assert configs[1].kv_cache.max_entries == 1
    assert configs[1].kv_cache.min_tokens == 8
    async with open_pipeline(path, mix_factory(), environ=NO_ENV) as pipeline:
        result = await pipeline.prefill(prompt(20), session_id="s")
    assert [r.stage_id for r in result.stages] == ["a", "b"]


@pytest.mark.parametrize(
    ("body", "match"),
    [
        (
            '[[stage]]\nstage_id = "a"\nlayer_start = 0\nlayer_end = 3\n'
            '[[stage]]\nstage_id = "a"\nlayer_start = 3\nlayer_end = 6\n',
            r"topology.toml: line \d+: "
            r"stage\[1\].stage_id must be unique, got 'a' twice \(stage 'a'\)",
        ),
        (
            '[[stage]]\nstage_id = "a"\nlayer_start = 0\nlayer_end = 3\n'
            '[[stage]]\nstage_id = "b"\nlayer_start = 4\nlayer_end = 6\n',
            r"topology.toml: line \d+: stage\[1\].layer_start must equal the previous stage's "
            r"layer_end 3, got 4 \(stage 'b'\)",
        ),
        (  # a stage_index set in [defaults] fits only the first stage: the defaults' key
            '[defaults]\nmodel_id = "m"\nstage_index = 0\n'
            '[[stage]]\nstage_id = "a"\nlayer_start = 0\nlayer_end = 3\n'
            '[[stage]]\nstage_id = "b"\nlayer_start = 3\nlayer_end = 6\n',
            r"topology.toml: line \d+: defaults.stage_index must equal its position 1, got 0 "
            r"\(for stage\[1\] 'b'\)",
        ),
        ("[defaults]\nmodel_id = 'm'\n", r"topology.toml: stage must be a non-empty array"),
        (
            '[[stage]]\nstage_id = "a"\nlayer_start = 0\nlayer_end = 3\n'
            "[[stage]]\nlayer_start = 3\nlayer_end = 6\n",
            r"topology.toml: line \d+: missing required field stage\[1\].stage_id$",
        ),
        (
            '[[stage]]\nstage_id = "a"\nlayer_start = 0\nlayer_end = "x"\n',
            r"topology.toml: line \d+: "
            r"stage\[0\].layer_end must be an integer, got 'x' \(stage 'a'\)",
        ),
        (
            '[[stage]]\nstage_id = "a"\nlayer_start = 3\nlayer_end = 3\n',
            r"topology.toml: line \d+: stage\[0\].layer_end must be > layer_start \(3\), got 3",
        ),
        (  # the second [[stage]]'s key, not the first one's
            '[[stage]]\nstage_id = "a"\nlayer_start = 0\nlayer_end = 3\n'
            '[[stage]]\nstage_id = "b"\nlayer_start = 3\nlayer_end = 3\n',
            r"topology.toml: line \d+: stage\[1\].layer_end must be > layer_start \(3\), got 3",
        ),
        (  # a value every stage takes from [defaults]: the key in the defaults
            '[defaults]\nmodel_id = "m"\nctx_size = 0\n'
            '[[stage]]\nstage_id = "a"\nlayer_start = 0\nlayer_end = 3\n',
            r"topology.toml: line \d+: "
            r"defaults.ctx_size must be >= 1, got 0 \(for stage\[0\] 'a'\)",
        ),
        (  # a stage's own kv_cache sub-table
            '[[stage]]\nstage_id = "a"\nlayer_start = 0\nlayer_end = 3\n'
            '[[stage]]\nstage_id = "b"\nlayer_start = 3\nlayer_end = 6\n'
            '[stage.kv_cache]\nmode = "lookup-record"\nmax_entries = 0\n',
            r"topology.toml: line \d+: "
            r"stage\[1\].kv_cache.max_entries must be >= 1, got 0 \(stage 'b'\)",
        ),
        (  # a neighbour's bad id is that stage's error, not a bad downstream of the first
            '[[stage]]\nstage_id = "a"\nlayer_start = 0\nlayer_end = 3\n'
            "[[stage]]\nstage_id = 7\nlayer_start = 3\nlayer_end = 6\n",
            r"topology.toml: line \d+: stage\[1\].stage_id must be a string, got 7",
        ),
        (
            '[[stage]]\nstage_id = "a"\nlayer_start = 0\nlayer_end = ' + "9" * 4400 + "\n",
            r"topology.toml: an integer of more than 4300 digits is out of range",
        ),
        (  # peers must be the neighbours: frames go from each stage to the next
            '[[stage]]\nstage_id = "a"\nlayer_start = 0\nlayer_end = 3\n'
            '[[stage]]\nstage_id = "b"\nlayer_start = 3\nlayer_end = 6\nupstream = "x"\n',
            r"topology.toml: line \d+: stage\[1\].upstream must be the previous stage 'a', "
            r"got 'x' \(stage 'b'\)",
        ),
        (
            '[[stage]]\nstage_id = "a"\nlayer_start = 0\nlayer_end = 3\ndownstream = "c"\n'
            '[[stage]]\nstage_id = "b"\nlayer_start = 3\nlayer_end = 6\n',
            r"topology.toml: line \d+: stage\[0\].downstream must be the next stage 'b', got 'c'",
        ),
        ("[[stage]\n", r"topology.toml: invalid TOML"),
        (
            "[stages]\n",
            r"topology.toml: line \d+: unknown field stages \(known fields: defaults, model, ",
        ),
        ("defaults = 3\n", r"topology.toml: line \d+: defaults must be a table, got 3$"),
    ],
)
def test_invalid_topology_names_file_stage_and_field(tmp_path: Path, body: str, match: str) -> None:
    """Topology errors are ConfigErrors naming the file, the key path of the field (in its
    stage's table or in the defaults) and the stage."""
    path = tmp_path / "topology.toml"
    path.write_text('[defaults]\nmodel_id = "m"\n' + body if "defaults" not in body else body)
    with pytest.raises(ConfigError, match=match):
        load_topology(path)


def test_topology_and_config_files_may_start_with_a_byte_order_mark(tmp_path: Path) -> None:
    """Some editors write a UTF-8 BOM: it is not part of the document."""
    path = tmp_path / "topology.toml"
    path.write_bytes(
        b'\xef\xbb\xbf[[stage]]\nstage_id = "a"\nmodel_id = "m"\nlayer_start = 0\nlayer_end = 3\n'
    )
    assert [stage.stage_id for stage in load_topology(path)] == ["a"]
    single = tmp_path / "stage.toml"
    single.write_bytes(
        b'\xef\xbb\xbfstage_id = "a"\nmodel_id = "m"\nlayer_start = 0\nlayer_end = 3\n'
    )
    assert StageConfig.load(single).stage_id == "a"


def test_a_path_with_a_nul_byte_is_a_config_error() -> None:
    """Not a ValueError from open(): the path is named."""
    with pytest.raises(ConfigError, match="cannot read topology file: embedded null byte"):
        load_topology("topo\x00.toml")
    with pytest.raises(ConfigError, match="cannot read config file: embedded null byte"):
        StageConfig.load("stage\x00.toml")


def test_topology_that_is_not_utf8_names_the_line(tmp_path: Path) -> None:
    """A byte that is not UTF-8 is a ConfigError with the file and line, not a decode error."""
    path = tmp_path / "topology.toml"
    path.write_bytes(b'[[stage]]\nstage_id = "\xff"\n')
    expected = f"^{re.escape(str(path))}: line 2: topology file must be UTF-8, got byte 0xff$"
    with pytest.raises(ConfigError, match=expected):
        load_topology(path)


async def test_stage_list_is_validated_before_starting() -> None:
    """open_pipeline rejects stage lists whose indices or layers do not line up."""
    configs = stage_configs(2)
    with pytest.raises(ConfigError, match="stage_index must equal its position 0, got 1"):
        async with open_pipeline(configs[1:], mix_factory()):
            pass
    with pytest.raises(ConfigError, match="channel_size must be an integer >= 0, got -1"):
        async with open_pipeline(configs, mix_factory(), channel_size=-1):
            pass
    with pytest.raises(ConfigError, match="model_factory must be callable, got str"):
        async with open_pipeline(configs, "CausalMixModel"):  # type: ignore[arg-type]
            pass


@st.composite
def workloads(draw: st.DrawFn) -> tuple[list[StageConfig], list[np.ndarray[Any, Any]], bool]:
    """Random cache bounds and prompts built from shared blocks (so prefixes repeat)."""
    blocks = draw(
        st.lists(st.lists(st.integers(0, 50_000), min_size=1, max_size=12), min_size=2, max_size=4)
    )
    chains: list[list[int]] = []
    for _ in range(draw(st.integers(1, 7))):
        # Most prompts continue (a prefix of) an earlier one, like a conversation's next turn.
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
        max_entries=draw(st.integers(1, 6)),
        max_bytes=draw(st.sampled_from([0, 0, row_bytes * 8, row_bytes * 40])),
        min_tokens=draw(st.integers(1, 8)),
        stride=draw(st.integers(0, 8)),
        record_limit=draw(st.integers(0, 3)),
    )
    return configs, prompts, draw(st.booleans())


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(workload=workloads())
def test_cached_pipeline_equals_uncached_pipeline(
    workload: tuple[list[StageConfig], list[np.ndarray[Any, Any]], bool],
) -> None:
    """For any prompts and cache bounds, outputs equal an uncached pipeline's, and every stage
    computes exactly the tokens it did not restore."""
    configs, prompts, concurrent = workload
    factory = mix_factory(width=4)
    registry = ModelRegistry(factory)

    async def run() -> tuple[list[PrefillResult], list[PrefillResult]]:
        cached: dict[int, PrefillResult] = {}
        async with open_pipeline(configs, registry, environ=NO_ENV) as pipeline:
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
        assert computed(want) == [want.tokens] * len(configs)
    # what the reports claim is what each stage's model was asked to compute: (k, N) per prefill
    # that was not restored whole
    for config in configs:
        claimed = sorted(
            (report.restored_tokens, got.tokens)
            for got in cached
            for report in got.stages
            if report.stage_id == config.stage_id and report.computed_tokens
        )
        assert sorted(registry.models[config.stage_id].calls) == claimed


async def test_a_stopped_pipeline_answers_with_pipeline_errors_not_actor_internals(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """After a normal exit stats() gives the final numbers and clear_caches() has no caches;
    after a cancelled one there are no final numbers. Both say so as PipelineStoppedError."""
    configs = stage_configs(2, min_tokens=8, stride=8)
    async with open_pipeline(configs, mix_factory(), environ=NO_ENV) as pipeline:
        await pipeline.prefill(prompt(20), session_id="s")
    final = await pipeline.statistics()
    assert [s.cache.records if s.cache else None for s in final.stages] == [2, 2]
    with pytest.raises(PipelineStoppedError, match="pipeline has stopped: no cache to clear"):
        await pipeline.clear_caches()

    with trio.move_on_after(1):  # leaves the block by cancellation: no orderly drain
        async with open_pipeline(configs, mix_factory(), environ=NO_ENV) as cancelled:
            await trio.sleep_forever()
    with pytest.raises(PipelineStoppedError, match="pipeline has stopped without final"):
        await cancelled.statistics()


@pytest.mark.parametrize("name", ["STAGE_RUNTIME_KV_CACHE", "STAGE_RUNTIME_PREFIX_CACHE"])
async def test_a_mistyped_cache_mode_variable_is_warned_about_naming_its_value(
    name: str, logs: list[LogEvent]
) -> None:
    """An unrecognised mode leaves the cache off (spec §6.1), but not silently: a warning names
    the variable, its value and the values it accepts (issue 21)."""
    no_block = [attrs.evolve(config, kv_cache=None) for config in stage_configs(2)]
    async with open_pipeline(no_block, mix_factory(), environ={name: "maybe"}) as pipeline:
        result = await pipeline.prefill(prompt(300), session_id="s")
        again = await pipeline.prefill(prompt(300), session_id="s")
    assert restored(result) == restored(again) == [0, 0]
    [warning] = events_named(logs, "cache_mode_unrecognised")
    assert warning["log_level"] == "warning"
    assert (warning["variable"], warning["value"]) == (name, "maybe")
    assert {"off", "record", "lookup-record", "auto"} <= set(warning["accepted"])


async def test_a_recognised_cache_mode_variable_is_not_warned_about(logs: list[LogEvent]) -> None:
    """Accepted spellings (any case, padded, ``_`` for ``-``) raise no warning."""
    no_block = [attrs.evolve(config, kv_cache=None) for config in stage_configs(1)]
    for value in (" Lookup_Record ", "OFF", "", "1"):
        async with open_pipeline(
            no_block, mix_factory(), environ={"STAGE_RUNTIME_KV_CACHE": value}
        ):
            pass
    assert events_named(logs, "cache_mode_unrecognised") == []
