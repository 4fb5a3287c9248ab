"""Models and logging set-ups that tests send to Ray stage processes.

The Ray fixture registers this module to be pickled by value, so stage processes need not be
able to import the test suite.
"""

from __future__ import annotations

import json
import logging
from collections.abc import MutableMapping
from typing import Any

import attrs
import numpy as np
import numpy.typing as npt
import structlog
import trio

from stage_runtime.config import StageConfig
from stage_runtime.frames import ActivationFrame
from stage_runtime.models import CausalMixModel, StageModel

SLOW_LENGTH = 77
"""Prompts of exactly this many tokens sleep in the slow stage's forward (see ProbeModels)."""

FAIL_TOKEN = 900_002
"""A prompt holding this token fails in stage 0's embedding."""


@attrs.define(eq=False)
class _TestModel:
    """A :class:`CausalMixModel` that can sleep or fail on marker tokens."""

    inner: CausalMixModel
    slow: bool
    delay_s: float

    @property
    def activation_width(self) -> int:
        return self.inner.activation_width

    def embed(self, tokens: npt.NDArray[np.int32]) -> ActivationFrame:
        if FAIL_TOKEN in tokens:
            msg = f"cannot embed token {FAIL_TOKEN}"
            raise ValueError(msg)
        return self.inner.embed(tokens)

    async def forward(
        self, inputs: ActivationFrame, start: int, restored: ActivationFrame | None
    ) -> ActivationFrame:
        if self.slow and inputs.token_count == SLOW_LENGTH:
            await trio.sleep(self.delay_s)
        return await self.inner.forward(inputs, start, restored)


@attrs.frozen
class ProbeModels:
    """A model factory: reference models of ``width``; the stage at ``slow_stage`` sleeps
    ``delay_s`` in forward for prompts of :data:`SLOW_LENGTH` tokens."""

    width: int = 16
    slow_stage: int | None = None
    delay_s: float = 60.0

    def __call__(self, config: StageConfig) -> StageModel:
        return _TestModel(
            CausalMixModel.for_stage(config, width=self.width),
            slow=config.stage_index == self.slow_stage,
            delay_s=self.delay_s,
        )


@attrs.frozen
class Failing:
    """A model factory that raises (the stage cannot start)."""

    def __call__(self, config: StageConfig) -> StageModel:
        msg = f"no weights for {config.stage_id}"
        raise RuntimeError(msg)


@attrs.frozen
class LogToFile:
    """A stage process's logging set-up: JSON lines appended to ``path``."""

    path: str

    def __call__(self) -> None:
        handle = open(self.path, "a", encoding="utf-8", buffering=1)  # noqa: SIM115

        def write(_logger: object, _name: str, event: MutableMapping[str, Any]) -> str:
            handle.write(json.dumps(event, default=str) + "\n")
            return ""

        structlog.configure(
            processors=[structlog.contextvars.merge_contextvars, write],
            wrapper_class=structlog.make_filtering_bound_logger(logging.DEBUG),
            logger_factory=structlog.ReturnLoggerFactory(),
            cache_logger_on_first_use=False,
        )
