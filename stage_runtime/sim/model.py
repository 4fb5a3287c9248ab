"""The simulated stage model: virtual activations, virtual-time cost."""

from __future__ import annotations

import attrs
import numpy as np
import numpy.typing as npt
import trio

from stage_runtime._validators import is_int
from stage_runtime.config import StageConfig
from stage_runtime.errors import ConfigError, FrameError, shown
from stage_runtime.frames import ActivationDType, ActivationFrame
from stage_runtime.limits import I32_MAX, MAX_VIRTUAL_BYTES, U32_MAX
from stage_runtime.models import ModelFactory, StageModel
from stage_runtime.sim.cost import CostModel

__all__ = ["SimulatedStageModel", "simulated_model_factory"]

_BYTES_PER_ELEMENT = 2  # bf16


def _forget_template(instance: SimulatedStageModel, _attribute: object, value: int) -> int:
    """Drop a model's frame template when a field it is made from is set (attrs' on_setattr):
    the next frame makes a new one, so frames never need to compare the template's fields."""
    instance._template = None
    return value


@attrs.define(eq=False)
class SimulatedStageModel:
    """A stage model that moves realistic byte counts and spends virtual time, and nothing else.

    Frames are virtual (``ActivationFrame.virtual``: ``bytes_per_token`` bytes per token,
    zero-stride payload, no memory), typed bf16 with width
    ``bytes_per_token / 2``: the default 8,192 bytes per token is a 4,096-wide bf16 activation.
    :meth:`forward` sleeps ``cost.stage_cost(...)``: the computed tokens at the prefill cost plus
    the restored prefix's bytes at the restore cost; :meth:`full_restore` sleeps the restore
    cost when the cache held the whole prompt (the stage then runs no forward). Run under a
    virtual clock (``trio.testing.MockClock(autojump_threshold=0)``) the sleeps take no wall
    time. With
    ``sleep=False`` it only returns frames: for callers that add the costs up themselves (a
    replay of one request at a time, where nothing overlaps, does).
    """

    bytes_per_token: int = attrs.field(default=8192, on_setattr=_forget_template)
    """Payload bytes per token row."""

    cost: CostModel = attrs.field(factory=CostModel)
    """What computing and restoring cost, in seconds."""

    stage_index: int = attrs.field(default=0, on_setattr=_forget_template)
    """Written into produced frames as ``producer_stage_index``."""

    layer_start: int = attrs.field(default=0, on_setattr=_forget_template)
    """Written into produced frames."""

    layer_end: int = attrs.field(default=0, on_setattr=_forget_template)
    """Written into produced frames."""

    sleep: bool = True
    """Whether :meth:`forward` sleeps its cost (virtual time) or returns at once."""

    _template: ActivationFrame | None = attrs.field(default=None, init=False, repr=False)
    """A checked one-token frame: every frame is this one with other counts (forgotten when a
    field it is made from changes)."""

    def __attrs_post_init__(self) -> None:
        if self.bytes_per_token < 1:
            msg = f"bytes_per_token must be >= 1, got {self.bytes_per_token}"
            raise ConfigError(msg)

    @property
    def activation_width(self) -> int:
        """Elements per token row (bf16), the width in cache keys."""
        width = self.bytes_per_token // _BYTES_PER_ELEMENT
        return width if width > 1 else 1  # (max(), but read twice per stage and request)

    def embed(self, tokens: npt.NDArray[np.int32]) -> ActivationFrame:
        """A virtual frame with one row per token."""
        return self.frame(int(np.size(tokens)))

    async def forward(
        self, inputs: ActivationFrame, start: int, restored: ActivationFrame | None
    ) -> ActivationFrame:
        """Sleep for the restore and the computed tokens; return ``N - start`` virtual rows."""
        n = inputs.token_count
        if not 0 <= start < n:
            msg = f"start must be in [0, {n}) for a {n}-token input, got {start}"
            raise FrameError(msg)
        if self.sleep:  # (else the caller adds the costs up: nothing to work out here)
            await self._spend(n - start, 0 if restored is None else restored.payload_bytes)
        return self.frame(n - start)

    async def full_restore(self, restored: ActivationFrame) -> None:
        """Sleep for restoring the whole prompt (the stage runs no forward then)."""
        if self.sleep:
            await self._spend(0, restored.payload_bytes)

    async def _spend(self, computed_tokens: int, restored_bytes: int) -> None:
        """Sleep what computing and restoring cost this stage."""
        delay = self.cost.stage_cost(
            computed_tokens=computed_tokens,
            restored_bytes=restored_bytes,
            stage_index=self.stage_index,
        )
        if delay > 0:
            await trio.sleep(delay)

    def frame(self, token_count: int) -> ActivationFrame:
        """The virtual frame this stage outputs for ``token_count`` tokens (what the next stage
        receives; a stage replayed alone gets its input from its predecessor's model).

        Raises:
            FrameError: ``token_count`` is not a count ``ActivationFrame.virtual`` accepts.
        """
        template = self._template
        if template is None:
            template = self._template = self._checked_frame(1)
        if (
            type(token_count) is int
            and 0 <= token_count <= U32_MAX
            and token_count * self.bytes_per_token <= MAX_VIRTUAL_BYTES
        ):
            # Every field was checked once, in the template: only the counts differ.
            return template._virtual_rows(token_count)
        return self._checked_frame(token_count)

    def _checked_frame(self, token_count: int) -> ActivationFrame:
        return ActivationFrame.virtual(
            token_count=token_count,
            bytes_per_token=self.bytes_per_token,
            dtype=ActivationDType.BF16,
            producer_stage_index=self.stage_index,
            layer_start=self.layer_start,
            layer_end=self.layer_end,
        )


def simulated_model_factory(
    *, bytes_per_token: int = 8192, cost: CostModel | None = None, sleep: bool = True
) -> ModelFactory:
    """A model factory for ``open_pipeline``: one :class:`SimulatedStageModel` per stage.

    Args:
        bytes_per_token: Payload bytes per token row.
        cost: Virtual-time costs; :class:`CostModel` defaults when None.
        sleep: Whether the models sleep their cost (see :class:`SimulatedStageModel`).

    Returns:
        A callable building a :class:`SimulatedStageModel` from a stage's configuration.
    """
    if cost is not None and not isinstance(cost, CostModel):
        msg = f"cost must be a CostModel or None, got {type(cost).__name__}"
        raise ConfigError(msg)
    costs = CostModel() if cost is None else cost
    if not is_int(bytes_per_token):
        msg = f"bytes_per_token must be an integer, got {shown(bytes_per_token)}"
        raise ConfigError(msg)
    if bytes_per_token < 1:
        msg = f"bytes_per_token must be >= 1, got {bytes_per_token}"
        raise ConfigError(msg)
    if bytes_per_token // _BYTES_PER_ELEMENT > I32_MAX:
        # Its bf16 width is every cache key's activation_width: the stages failed as they started.
        msg = (
            f"bytes_per_token must be <= {(I32_MAX + 1) * _BYTES_PER_ELEMENT - 1:,} (a bf16 "
            f"width within int32), got {bytes_per_token:,}"
        )
        raise ConfigError(msg)

    def build(config: StageConfig) -> StageModel:
        return SimulatedStageModel(
            bytes_per_token=bytes_per_token,
            cost=costs,
            stage_index=config.stage_index,
            layer_start=config.layer_start,
            layer_end=config.layer_end,
            sleep=sleep,
        )

    return build
