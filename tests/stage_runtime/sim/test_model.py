"""The simulated stage model: virtual payloads of realistic size, costs in virtual time."""

from __future__ import annotations

import re

import attrs
import numpy as np
import pytest
import trio
import trio.testing

from stage_runtime import ConfigError
from stage_runtime.errors import FrameError
from stage_runtime.frames import ActivationDType, ActivationFrame
from stage_runtime.sim import CostModel, SimulatedStageModel, simulated_model_factory

COST = CostModel(prefill_s_per_token=1e-3, restore_s_per_byte=1e-6)


def test_frames_have_the_bytes_of_the_tokens_but_no_memory() -> None:
    """A million-token frame reports 8 GB at 8,192 B per token and allocates nothing."""
    model = SimulatedStageModel(bytes_per_token=8192, stage_index=2, layer_start=16, layer_end=24)
    frame = model.embed(np.zeros(1_000_000, dtype=np.int32))
    assert frame.is_virtual
    assert frame.token_count == 1_000_000
    assert frame.payload_bytes == 1_000_000 * 8192
    assert frame.payload.strides[0] == 0  # every row is the same memory: a zero-stride view
    assert (frame.desc.producer_stage_index, frame.desc.layer_start) == (2, 16)
    assert model.activation_width == 4096  # bf16: two bytes per element


@pytest.mark.parametrize("count", [0, 1, 7, 40_000])
def test_frames_equal_what_the_checked_constructor_makes(count: int) -> None:
    """The model makes frames from one checked template without re-running the validators:
    each equals ``ActivationFrame.virtual`` of the same fields, read-only and zero-stride;
    a field changed after the model was built is in the next frame."""
    model = SimulatedStageModel(bytes_per_token=6, stage_index=1, layer_start=4, layer_end=8)
    expected = ActivationFrame.virtual(
        token_count=count,
        bytes_per_token=6,
        dtype=ActivationDType.BF16,
        producer_stage_index=1,
        layer_start=4,
        layer_end=8,
    )
    frame = model.frame(count)
    assert frame.desc == expected.desc
    assert frame.same_content(expected)
    assert not frame.payload.flags.writeable
    model.layer_end = 12
    model.bytes_per_token = 10
    assert model.frame(count).desc == attrs.evolve(
        expected.desc, layer_end=12, payload_bytes=count * 10
    )


@pytest.mark.parametrize("count", [-1, 2**32, 3.0, True])
def test_a_bad_frame_count_is_a_frame_error(count: object) -> None:
    """A count the checked constructor refuses is refused by name, whatever the template."""
    model = SimulatedStageModel(bytes_per_token=4)
    with pytest.raises(FrameError, match="token_count"):
        model.frame(count)  # type: ignore[arg-type]


async def test_forward_sleeps_computed_tokens_and_restored_bytes(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """100 tokens, 60 restored: 40 computed x 1 ms + 60 x 4 B x 1 us = 40.24 ms of virtual time."""
    model = SimulatedStageModel(bytes_per_token=4, cost=COST)
    inputs = model.embed(np.zeros(100, dtype=np.int32))
    start = trio.current_time()
    out = await model.forward(inputs, 60, inputs.prefix(60))
    assert trio.current_time() - start == pytest.approx(0.04024)
    assert (out.token_count, out.payload_bytes, out.is_virtual) == (40, 160, True)


async def test_without_sleep_forward_returns_at_once(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """sleep=False (one request at a time, costs added up by the driver) spends no time."""
    model = SimulatedStageModel(bytes_per_token=4, cost=COST, sleep=False)
    inputs = model.embed(np.zeros(100, dtype=np.int32))
    start = trio.current_time()
    out = await model.forward(inputs, 0, None)
    assert trio.current_time() == start
    assert out.token_count == 100


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"bytes_per_token": "8"}, "bytes_per_token must be an integer, got '8'"),
        ({"bytes_per_token": 0}, "bytes_per_token must be >= 1, got 0"),
        (
            {"bytes_per_token": 2**40},
            "bytes_per_token must be <= 4,294,967,295 (a bf16 width within int32), "
            "got 1,099,511,627,776",
        ),
        ({"cost": 0.5}, "cost must be a CostModel or None, got float"),
    ],
)
def test_the_factory_checks_its_arguments_when_called(
    kwargs: dict[str, object], message: str
) -> None:
    """A bad argument fails where the factory is made: a string was a TypeError there, and
    a size whose width no cache key holds passed and failed every stage as it started."""
    with pytest.raises(ConfigError, match=f"^{re.escape(message)}$"):
        simulated_model_factory(**kwargs)  # type: ignore[arg-type]


async def test_bad_start_and_sizes_are_refused() -> None:
    """A start outside the input and a size below one byte per token are named errors."""
    model = SimulatedStageModel(bytes_per_token=4, cost=COST)
    inputs = model.embed(np.zeros(10, dtype=np.int32))
    with pytest.raises(FrameError, match="start must be in \\[0, 10\\) for a 10-token input"):
        await model.forward(inputs, 10, None)
    with pytest.raises(ConfigError, match="bytes_per_token must be >= 1, got 0"):
        SimulatedStageModel(bytes_per_token=0)
