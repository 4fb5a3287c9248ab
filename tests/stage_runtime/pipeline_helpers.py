"""Shared builders for the stage and pipeline tests (imported explicitly by the test modules)."""

from __future__ import annotations

from typing import Any

import attrs
import numpy as np
import numpy.typing as npt

from stage_runtime.config import CacheMode, CachePayload, KvCacheConfig, StageConfig
from stage_runtime.frames import ActivationFrame
from stage_runtime.models import CausalMixModel, ModelFactory, StageModel


def stage_configs(
    count: int = 2,
    *,
    mode: CacheMode = CacheMode.LOOKUP_RECORD,
    max_entries: int = 8,
    max_bytes: int = 0,
    min_tokens: int = 256,
    stride: int = 128,
    record_limit: int = 2,
    layers_per_stage: int = 4,
) -> list[StageConfig]:
    """``count`` contiguous stages sharing one cache configuration."""
    kv = KvCacheConfig(
        mode=mode,
        payload=CachePayload.RESIDENT_KV,
        max_entries=max_entries,
        max_bytes=max_bytes,
        min_tokens=min_tokens,
        shared_prefix_stride_tokens=stride,
        shared_prefix_record_limit=record_limit,
    )
    return [
        StageConfig(
            model_id="org/model:Q4_K_M",
            stage_id=f"stage-{i}",
            stage_index=i,
            layer_start=i * layers_per_stage,
            layer_end=(i + 1) * layers_per_stage,
            kv_cache=kv,
            upstream=f"stage-{i - 1}" if i else None,
            downstream=f"stage-{i + 1}" if i + 1 < count else None,
        )
        for i in range(count)
    ]


def uncached(configs: list[StageConfig]) -> list[StageConfig]:
    """The same stages with caching disabled."""
    off = KvCacheConfig(mode=CacheMode.DISABLED)
    return [attrs.evolve(config, kv_cache=off) for config in configs]


def prompt(n: int, start: int = 0) -> npt.NDArray[np.int32]:
    return np.arange(start, start + n, dtype=np.int32)


@attrs.define(eq=False)
class ForwardingModel:
    """The width and ``forward`` of ``inner``, and no embedding (a later stage's model)."""

    inner: StageModel

    @property
    def activation_width(self) -> int:
        """Width of the wrapped model."""
        return self.inner.activation_width

    async def forward(
        self, inputs: ActivationFrame, start: int, restored: ActivationFrame | None
    ) -> ActivationFrame:
        """Compute with the wrapped model."""
        return await self.inner.forward(inputs, start, restored)


@attrs.define(eq=False)
class WrappedModel(ForwardingModel):
    """A model that does what ``inner`` does; test doubles override the part they change."""

    def embed(self, tokens: npt.NDArray[np.int32]) -> ActivationFrame:
        """Embed with the wrapped model."""
        return self.inner.embed(tokens)


@attrs.define(eq=False)
class CountingModel(WrappedModel):
    """Wraps a model; counts forward calls, can block on an event or fail on a token."""

    calls: list[tuple[int, int]] = attrs.field(factory=list)
    """(start, N) of every forward call."""
    fail_on_token: int | None = None
    """forward raises ValueError when this token id is in the prompt (stage 0 embeds it)."""
    gate: Any = None
    """A trio.Event forward waits for, when set."""

    def embed(self, tokens: npt.NDArray[np.int32]) -> ActivationFrame:
        if self.fail_on_token is not None and self.fail_on_token in tokens:
            msg = f"cannot embed token {self.fail_on_token}"
            raise ValueError(msg)
        return self.inner.embed(tokens)

    async def forward(
        self, inputs: ActivationFrame, start: int, restored: ActivationFrame | None
    ) -> ActivationFrame:
        self.calls.append((start, inputs.token_count))
        if self.gate is not None:
            await self.gate.wait()
        return await self.inner.forward(inputs, start, restored)


@attrs.define(eq=False)
class ModelRegistry:
    """A model factory that remembers the model it built for each stage."""

    factory: ModelFactory
    models: dict[str, CountingModel] = attrs.field(factory=dict)

    def __call__(self, config: StageConfig) -> StageModel:
        model = CountingModel(self.factory(config))
        self.models[config.stage_id] = model
        return model


def mix_factory(width: int = 8) -> ModelFactory:
    def build(config: StageConfig) -> StageModel:
        return CausalMixModel.for_stage(config, width=width)

    return build
