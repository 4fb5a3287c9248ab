"""The upstream seed's test fixtures: test_config(), test_base(), activation_frame().

Plus :func:`cache_state`, what tests compare to show a call left a cache unchanged.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from stage_runtime import (
    ActivationDesc,
    ActivationDType,
    ActivationFrame,
    ActivationLayout,
    CacheMode,
    KvCacheConfig,
    StageConfig,
)
from stage_runtime.cache import ResidentActivationCache
from stage_runtime.config import CachePayload, LoadMode, MessageBase
from stage_runtime.integration import KvStageIntegration

MODEL = "hugging-quants/Llama-3.2-1B-Instruct-GGUF:Q4_K_M"


def seed_config() -> StageConfig:
    """The seed's test_config(): stage-0, layers 0..4, ctx 8192, lookup-record, 8 entries."""
    return StageConfig(
        run_id="run",
        topology_id="topology",
        model_id=MODEL,
        stage_id="stage-0",
        stage_index=0,
        layer_start=0,
        layer_end=4,
        ctx_size=8192,
        lane_count=2,
        n_gpu_layers=0,
        cache_type_k="f16",
        cache_type_v="f16",
        load_mode=LoadMode.RUNTIME_SLICE,
        kv_cache=KvCacheConfig(
            mode=CacheMode.LOOKUP_RECORD,
            payload=CachePayload.RESIDENT_KV,
            max_entries=8,
            max_bytes=0,
            min_tokens=256,
            shared_prefix_stride_tokens=128,
            shared_prefix_record_limit=2,
        ),
    )


def seed_base() -> MessageBase:
    """The seed's test_base(): session "session", namespace "template", no tokenizer."""
    return MessageBase(
        run_id="run",
        request_id="request",
        session_id="session",
        stage_id="stage-0",
        stage_index=0,
        topology_id="topology",
        model_id=MODEL,
        tokenizer_id=None,
        chat_template_id="template",
        seq=1,
    )


def activation_frame(token_count: int, payload_bytes: int, *, flags: int = 0) -> ActivationFrame:
    """The seed's activation_frame(): F32, token-major, layers 0..4, payload of 7s."""
    desc = ActivationDesc(
        version=1,
        dtype=ActivationDType.F32,
        layout=ActivationLayout.TOKEN_MAJOR,
        producer_stage_index=0,
        layer_start=0,
        layer_end=4,
        token_count=token_count,
        sequence_count=1,
        payload_bytes=payload_bytes,
        flags=flags,
    )
    return ActivationFrame(desc=desc, payload=np.full(payload_bytes, 7, dtype=np.uint8))


def seed_integration(config: StageConfig | None = None) -> KvStageIntegration:
    """KvStageIntegration.from_config(test_config()), asserting the cache is enabled."""
    kv = KvStageIntegration.from_config(config or seed_config(), environ={})
    assert kv is not None, "resident cache enabled"
    return kv


def cache_state(cache: ResidentActivationCache) -> tuple[Any, ...]:
    """Everything a cache shows without touching it: clock, keys in LRU order, counters."""
    return cache.clock, cache.keys(), cache.stats()
