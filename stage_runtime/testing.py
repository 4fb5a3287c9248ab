"""pytest fixtures for testing code that uses stage-runtime (a ``pytest11`` plugin).

Installing stage-runtime registers this module with pytest, so these fixtures are available in
any project's tests without a ``conftest.py``. The async fixtures run on trio: enable
pytest-trio's ``trio_mode = true`` (or mark the tests ``@pytest.mark.trio``).

``stage_config``
    A small valid :class:`~stage_runtime.config.StageConfig` with the activation cache on
    (``lookup-record``, ``min_tokens=8``). Override the fixture to change the cache settings of
    ``pipeline`` and ``cache_actor``, which are built from it.
``pipeline``
    A running two-stage :class:`~stage_runtime.pipeline.Pipeline` with the reference model
    (``reference_model_factory(width=16)``), drained and stopped after the test.
``cache_actor``
    The :class:`~actors.ActorRef` of a running :class:`~stage_runtime.cache_actor.CacheActor`
    for ``stage_config``, stopped after the test.
``capture_stage_logs``
    A list that collects every structlog event of the test as a dict, including the keys bound
    with :mod:`structlog.contextvars` (``stage=``, ``actor=``), which
    ``structlog.testing.capture_logs()`` on its own drops.

Example::

    async def test_second_prefill_is_restored(pipeline, capture_stage_logs):
        tokens = list(range(64))
        await pipeline.prefill(tokens, session_id="a")
        result = await pipeline.prefill(tokens, session_id="a")
        assert all(stage.restored_tokens > 0 for stage in result.stages)
        assert any(e["event"] == "activation_restored" for e in capture_stage_logs)

This module never imports the HTTP server (hypercorn is an optional extra).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator, MutableMapping
from typing import Any

import attrs
import pytest
import structlog

from actors import ActorRef, open_actor
from actors.testing import capture_actor_logs
from stage_runtime.cache_actor import CacheActor, CacheMessage
from stage_runtime.config import CacheMode, KvCacheConfig, StageConfig
from stage_runtime.models import reference_model_factory
from stage_runtime.pipeline import Pipeline, open_pipeline

__all__ = ["cache_actor", "capture_stage_logs", "pipeline", "stage_config"]

PIPELINE_STAGES = 2
"""Stages of the ``pipeline`` fixture."""

PIPELINE_WIDTH = 16
"""Activation width of the ``pipeline`` fixture's reference model."""


@pytest.fixture
def stage_config() -> StageConfig:
    """A small valid stage configuration with the activation cache on."""
    return StageConfig(
        stage_id="stage-0",
        stage_index=0,
        model_id="test/reference",
        topology_id="test-topology",
        layer_start=0,
        layer_end=4,
        ctx_size=4096,
        kv_cache=KvCacheConfig(
            mode=CacheMode.LOOKUP_RECORD,
            max_entries=32,
            min_tokens=8,
            shared_prefix_stride_tokens=16,
        ),
    )


@pytest.fixture
async def pipeline(stage_config: StageConfig) -> AsyncIterator[Pipeline]:
    """A running two-stage pipeline built from ``stage_config``, with the reference model."""
    span = stage_config.layer_end - stage_config.layer_start
    ids = [f"stage-{index}" for index in range(PIPELINE_STAGES)]
    stages = [
        attrs.evolve(
            stage_config,
            stage_id=ids[index],
            stage_index=index,
            layer_start=index * span,
            layer_end=(index + 1) * span,
            upstream=ids[index - 1] if index > 0 else None,
            downstream=ids[index + 1] if index + 1 < PIPELINE_STAGES else None,
        )
        for index in range(PIPELINE_STAGES)
    ]
    # environ={} keeps the test independent of STAGE_RUNTIME_KV_CACHE* variables in the shell.
    async with open_pipeline(
        stages, reference_model_factory(width=PIPELINE_WIDTH), environ={}
    ) as running:
        yield running


@pytest.fixture
async def cache_actor(stage_config: StageConfig) -> AsyncIterator[ActorRef[CacheMessage, Any]]:
    """A running cache actor owning the cache of ``stage_config``."""
    async with open_actor(
        CacheActor(stage_config, environ={}), name=f"cache-{stage_config.stage_id}"
    ) as ref:
        yield ref


@pytest.fixture
def capture_stage_logs() -> Iterator[list[MutableMapping[str, Any]]]:
    """Every structlog event of the test (any level), with contextvars-bound keys kept.

    The test starts with no contextvars bound, so keys an earlier test bound and never unbound
    do not show up in its events; the earlier bindings are restored afterwards.
    """
    bound = structlog.contextvars.get_contextvars()
    structlog.contextvars.clear_contextvars()
    try:
        with capture_actor_logs() as logs:
            yield logs
    finally:
        structlog.contextvars.clear_contextvars()
        structlog.contextvars.bind_contextvars(**bound)
