"""Tests of the stage model protocol and the reference models."""

from __future__ import annotations

import re
import threading
from typing import Any

import numpy as np
import pytest
import trio
from hypothesis import given, settings
from hypothesis import strategies as st

from stage_runtime import models
from stage_runtime.config import StageConfig
from stage_runtime.errors import ConfigError, FrameError
from stage_runtime.frames import ActivationFrame
from stage_runtime.limits import MAX_REFERENCE_WIDTH
from stage_runtime.models import (
    EMBED_COST_MACS,
    CausalMixModel,
    StageModel,
    VirtualStageModel,
    reference_model_factory,
    virtual_model_factory,
)


def _config(index: int = 0) -> StageConfig:
    return StageConfig(
        stage_id=f"stage-{index}",
        stage_index=index,
        model_id="test/model",
        layer_start=4 * index,
        layer_end=4 * index + 4,
    )


async def _full(model: StageModel, inputs: ActivationFrame) -> ActivationFrame:
    return await model.forward(inputs, 0, None)


async def test_causal_mix_model_output_shape_and_frame_metadata() -> None:
    """The model maps N input rows to N float32 output rows stamped with its stage and layers."""
    model = CausalMixModel.for_stage(_config(1), width=8, seed=3)
    inputs = model.embed(np.arange(10, dtype=np.int32))
    out = await _full(model, inputs)
    assert out.rows().shape == (10, 8)
    assert out.rows().dtype == np.float32
    assert (out.desc.producer_stage_index, out.desc.layer_start, out.desc.layer_end) == (1, 4, 8)
    assert model.activation_width == 8


@settings(max_examples=25, deadline=None)
@given(
    tokens=st.lists(st.integers(-(2**31), 2**31 - 1), min_size=2, max_size=300),
    width=st.integers(1, 24),
    seed=st.integers(0, 1000),
    data=st.data(),
)
def test_continuing_from_a_restored_prefix_equals_computing_from_scratch(
    tokens: list[int], width: int, seed: int, data: st.DataObject
) -> None:
    """concat(out[:k], forward(x, k, out[:k])) equals forward(x, 0, None) within 1e-6."""
    k = data.draw(st.integers(1, len(tokens) - 1))
    model = CausalMixModel(width=width, seed=seed)
    inputs = model.embed(np.array(tokens, dtype=np.int32))
    full = trio.run(_full, model, inputs)
    restored = full.prefix(k)
    suffix = trio.run(model.forward, inputs, k, restored)
    joined = ActivationFrame.concat(restored, suffix)
    np.testing.assert_allclose(joined.rows(), full.rows(), rtol=1e-6, atol=1e-6)


async def test_output_row_depends_only_on_earlier_inputs() -> None:
    """Changing input row j leaves output rows before j unchanged and changes row j."""
    model = CausalMixModel(width=6, seed=1)
    a = model.embed(np.arange(50, dtype=np.int32))
    changed = np.arange(50, dtype=np.int32)
    changed[30] = 999
    b = model.embed(changed)
    out_a, out_b = await _full(model, a), await _full(model, b)
    np.testing.assert_array_equal(out_a.rows()[:30], out_b.rows()[:30])
    assert not np.allclose(out_a.rows()[30], out_b.rows()[30])


async def test_models_are_seeded_per_stage_and_deterministic() -> None:
    """The reference factory seeds each stage differently and repeatably."""
    factory = reference_model_factory(width=4, seed=7)
    tokens = np.arange(20, dtype=np.int32)
    stage0, again, stage1 = factory(_config(0)), factory(_config(0)), factory(_config(1))
    x = stage0.embed(tokens)
    np.testing.assert_array_equal((await _full(stage0, x)).rows(), (await _full(again, x)).rows())
    assert not np.allclose((await _full(stage0, x)).rows(), (await _full(stage1, x)).rows())


async def test_forward_rejects_inconsistent_restored_prefix() -> None:
    """A restored frame must hold exactly the tokens before start."""
    model = CausalMixModel(width=4)
    inputs = model.embed(np.arange(8, dtype=np.int32))
    full = await _full(model, inputs)
    with pytest.raises(FrameError, match="restored must hold the 3 tokens"):
        await model.forward(inputs, 3, full.prefix(2))
    with pytest.raises(FrameError, match="restored must hold"):
        await model.forward(inputs, 3, None)
    with pytest.raises(ConfigError, match="start must be in"):
        await model.forward(inputs, 8, full)


@pytest.mark.parametrize("width", [0, -3, MAX_REFERENCE_WIDTH + 1, 1_000_000, np.int64(10**9)])
def test_reference_width_must_be_within_its_bound(width: int) -> None:
    """A width below 1 or past the bound a topology and ``serve --width`` keep is a ConfigError
    naming width and the value, from the class, for_stage and the factory alike (a million
    wide used to pass, then fail each stage's first build with a MemoryError)."""
    message = f"^width must be an integer in \\[1, 8,192\\], got {re.escape(repr(width))}$"
    with pytest.raises(ConfigError, match=message):
        CausalMixModel(width=width)
    with pytest.raises(ConfigError, match=message):
        CausalMixModel.for_stage(_config(1), width=width)
    with pytest.raises(ConfigError, match=message):
        reference_model_factory(width=width)


def test_the_bound_itself_is_a_reference_width() -> None:
    """8,192 is accepted, not one past it (checked without building its 512 MiB matrix)."""
    assert models._reference_width(MAX_REFERENCE_WIDTH) == MAX_REFERENCE_WIDTH
    assert type(models._reference_width(np.int16(MAX_REFERENCE_WIDTH))) is int


@pytest.mark.parametrize(
    ("factory", "kwargs", "message"),
    [
        (
            reference_model_factory,
            {"width": "64"},
            "width must be an integer in [1, 8,192], got '64'",
        ),
        (reference_model_factory, {"seed": 1.5}, "seed must be an integer >= 0, got 1.5"),
        (
            reference_model_factory,
            {"thread_threshold_macs": -1},
            "thread_threshold_macs must be an integer >= 0, got -1",
        ),
        (virtual_model_factory, {"width": 0}, "width must be an integer >= 1, got 0"),
        (virtual_model_factory, {"width": True}, "width must be an integer >= 1, got True"),
        (  # the stages used to fail as they started, on the cache key's activation_width
            virtual_model_factory,
            {"width": 2**40},
            "width must be <= 2,147,483,647 (a cache key's activation_width), "
            "got 1,099,511,627,776",
        ),
        (
            virtual_model_factory,
            {"bytes_per_token": -8},
            "bytes_per_token must be an integer >= 0, got -8",
        ),
        (
            virtual_model_factory,
            {"seconds_per_token": float("nan")},
            "seconds_per_token must be a finite number >= 0, got nan",
        ),
        (
            virtual_model_factory,
            {"seconds_per_token": -1.0},
            "seconds_per_token must be a finite number >= 0, got -1.0",
        ),
    ],
)
def test_model_factories_check_their_arguments_when_called(
    factory: Any, kwargs: dict[str, object], message: str
) -> None:
    """A bad argument fails where the factory is made, not as a stage failure at start-up."""
    with pytest.raises(ConfigError, match=f"^{re.escape(message)}$"):
        factory(**kwargs)


def test_numpy_integer_arguments_become_ints() -> None:
    """numpy integers are accepted and stored as ints (they go into cache keys)."""
    model = CausalMixModel(width=np.int64(8), seed=np.int32(3))  # type: ignore[arg-type]
    assert (type(model.width), type(model.seed)) == (int, int)
    assert type(model.activation_width) is int


async def test_virtual_model_returns_virtual_frames_and_spends_virtual_time(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """The virtual model allocates nothing and sleeps per computed token."""
    model = virtual_model_factory(width=16, seconds_per_token=0.5)(_config(2))
    assert isinstance(model, VirtualStageModel)
    inputs = model.embed(np.arange(1000, dtype=np.int32))
    assert inputs.is_virtual
    assert inputs.payload_bytes == 1000 * 64
    start = trio.current_time()
    out = await model.forward(inputs, 990, inputs.prefix(990))
    assert trio.current_time() - start == pytest.approx(5.0)
    assert out.is_virtual
    assert out.token_count == 10
    assert out.desc.producer_stage_index == 2


def test_reference_models_satisfy_the_protocol() -> None:
    """Both reference models are StageModels."""
    assert isinstance(CausalMixModel(width=2), StageModel)
    assert isinstance(VirtualStageModel(width=2), StageModel)


async def test_causal_mix_model_runs_forwards_above_the_threshold_in_a_worker_thread(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """rows x width^2 above thread_threshold_macs computes off the event loop; the rest inline."""
    threads: list[int] = []
    compute = CausalMixModel._continue

    def recording(self: CausalMixModel, *args: object) -> object:
        threads.append(threading.get_ident())
        return compute(self, *args)  # type: ignore[arg-type]

    monkeypatch.setattr(CausalMixModel, "_continue", recording)
    model = CausalMixModel(width=8, thread_threshold_macs=10 * 8 * 8)
    small, large = (
        model.embed(np.arange(10, dtype=np.int32)),
        model.embed(np.arange(11, dtype=np.int32)),
    )
    await model.forward(small, 0, None)
    await model.forward(large, 0, None)
    assert threads[0] == threading.get_ident()
    assert threads[1] != threading.get_ident()


async def test_causal_mix_model_embeds_large_prompts_in_a_worker_thread(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A stage awaits embed_async: rows x width x EMBED_COST_MACS above the threshold leaves the
    event loop (at width 2,048 an 8,000-token embedding held it for about a second)."""
    threads: list[int] = []
    embed = CausalMixModel._embed_rows

    def recording(self: CausalMixModel, tokens: Any, stop: Any) -> Any:
        threads.append(threading.get_ident())
        return embed(self, tokens, stop)

    monkeypatch.setattr(CausalMixModel, "_embed_rows", recording)
    model = CausalMixModel(width=8, thread_threshold_macs=10 * 8 * EMBED_COST_MACS)
    small = await model.embed_async(np.arange(10, dtype=np.int32))
    large = await model.embed_async(np.arange(11, dtype=np.int32))
    assert threads[0] == threading.get_ident()
    assert threads[1] != threading.get_ident()
    np.testing.assert_array_equal(large.rows()[:10], small.rows())


@pytest.mark.parametrize("work", ["forward", "embed"])
async def test_cancelling_a_threaded_computation_stops_its_thread(
    monkeypatch: pytest.MonkeyPatch, work: str
) -> None:
    """The caller of a threaded forward (or embedding) that is cancelled gets control back at
    once, and the worker thread stops at its next chunk instead of computing the rest."""
    row_macs = 8 * 8 if work == "forward" else 8 * EMBED_COST_MACS
    monkeypatch.setattr(models, "CHUNK_MACS", row_macs)  # one row per chunk
    monkeypatch.setattr(models, "CHUNK_ROWS", 1)
    chunks: list[int] = []
    reached, gate, ended = threading.Event(), threading.Event(), threading.Event()
    outcome: list[str] = []
    check = models._check_stop

    def gated(stop: threading.Event | None) -> None:
        if stop is None:  # inline: not the computation under test
            return
        chunks.append(1)
        if len(chunks) == 2:
            reached.set()
            assert gate.wait(30)  # a bound, so that a bug fails instead of hanging
        check(stop)

    monkeypatch.setattr(models, "_check_stop", gated)
    name = "_continue" if work == "forward" else "_embed_rows"
    compute = getattr(CausalMixModel, name)

    def watched(self: CausalMixModel, *args: Any) -> Any:
        try:
            result = compute(self, *args)
        except BaseException as exc:
            outcome.append(type(exc).__name__)
            raise
        finally:
            ended.set()
        outcome.append("finished")
        return result

    monkeypatch.setattr(CausalMixModel, name, watched)
    model = CausalMixModel(width=8, thread_threshold_macs=0)
    inputs = model.embed(np.arange(30, dtype=np.int32))
    outcome.clear()
    ended.clear()
    scope = trio.CancelScope()
    returned = trio.Event()

    async def call() -> None:
        with scope:
            if work == "forward":
                await model.forward(inputs, 0, None)
            else:
                await model.embed_async(np.arange(30, dtype=np.int32))
        returned.set()

    async with trio.open_nursery() as nursery:
        nursery.start_soon(call)
        assert await trio.to_thread.run_sync(reached.wait, 30)  # the thread's second chunk
        scope.cancel()
        await returned.wait()  # the caller is back while the thread still waits
        assert outcome == []
        gate.set()
    assert await trio.to_thread.run_sync(ended.wait, 30)
    assert outcome == ["_Interrupted"]
    assert len(chunks) == 2  # of 30


async def test_causal_mix_model_output_is_the_same_inline_or_threaded() -> None:
    """Where a forward runs does not change its rows, cold or continued from a restore."""
    inline = CausalMixModel(width=16, seed=5)
    threaded = CausalMixModel(width=16, seed=5, thread_threshold_macs=0)
    inputs = inline.embed(np.arange(30, dtype=np.int32))
    cold = await inline.forward(inputs, 0, None)
    np.testing.assert_array_equal((await threaded.forward(inputs, 0, None)).rows(), cold.rows())
    continued = await threaded.forward(inputs, 12, cold.prefix(12))
    np.testing.assert_allclose(continued.rows(), cold.rows()[12:], atol=1e-6)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"seed": -1}, "seed must be an integer >= 0, got -1"),
        ({"thread_threshold_macs": -1}, "thread_threshold_macs must be an integer >= 0, got -1"),
    ],
)
def test_causal_mix_model_refuses_negative_seed_and_threshold(
    kwargs: dict[str, int], message: str
) -> None:
    """Negative seeds (numpy refuses them) and thresholds are ConfigErrors naming the field."""
    with pytest.raises(ConfigError, match=message):
        CausalMixModel(**kwargs)
    if "seed" in kwargs:
        with pytest.raises(ConfigError, match=message):
            reference_model_factory(seed=-1)
