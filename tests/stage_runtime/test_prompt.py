"""Grid fingerprints and the prompt's hash memo (stage_runtime.cache.prompt)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from stage_runtime.cache import StageCache
from stage_runtime.cache.prompt import (
    SAMPLE_TOKENS,
    GridFingerprints,
    grid_fingerprints,
)
from stage_runtime.config import CacheMode, KvCacheConfig, MessageBase, StageConfig
from stage_runtime.frames import ActivationFrame
from stage_runtime.policy import CandidatePolicy


def _definition(tokens: np.ndarray, count: int, stride: int) -> int:
    """A polynomial hash (mod 2**64, multiplier 0x9E3779B97F4A7C15) of the last two tokens of
    each whole block of ``stride`` tokens, read as one unsigned 64-bit value (the last token, as
    a signed int, for one-token blocks); then, when tokens remain, Python's ``hash`` of it and
    the bytes of the rest; XORed with ``count``."""
    blocks, part = divmod(count, stride)
    value = 0
    for block in range(blocks):
        end = (block + 1) * stride
        if stride >= SAMPLE_TOKENS:
            sample = int(tokens[end - 2 : end].view(np.uint64)[0])
        else:
            sample = int(tokens[end - 1])
        value = (value * 0x9E3779B97F4A7C15 + sample) % 2**64
    if part:
        value = hash((value, tokens[blocks * stride : count].tobytes()))
    return value ^ count


def _ladder_cache(grid: int) -> StageCache:
    """A ladder stage cache whose minimum length and stride are ``grid`` tokens."""
    config = StageConfig(stage_id="stage-0", model_id="m", layer_start=0, layer_end=4)
    cache_config = KvCacheConfig(
        mode=CacheMode.LOOKUP_RECORD, min_tokens=grid, shared_prefix_stride_tokens=grid
    )
    return StageCache(config, cache_config, CandidatePolicy.from_cache_config(cache_config))


@settings(max_examples=200, deadline=None)
@given(
    min_tokens=st.integers(0, 150),
    stride=st.integers(0, 150),
    tokens=st.lists(st.integers(-(2**31), 2**31 - 1), max_size=700),
)
def test_grid_fingerprints_follow_their_definition(
    min_tokens: int, stride: int, tokens: list[int]
) -> None:
    """Each candidate length's fingerprint is the hash of its prefix's sample, and position()
    is its index in the grid, whatever the grid's shape."""
    policy = CandidatePolicy(
        min_tokens=min_tokens, stride_tokens=stride, page_size_tokens=max(min_tokens, 1)
    )
    array = np.asarray(tokens, dtype=np.int32)
    grid = GridFingerprints(array, policy)
    stride_of = policy.effective_stride
    assert grid.counts == policy.candidate_token_counts(len(tokens))
    for index, count in enumerate(grid.counts):
        assert grid.prints[index] == _definition(array, count, stride_of)
        assert grid.position(count) == index
        if not grid.shared_prints:
            assert grid.by_print[grid.prints[index]] == count


@pytest.mark.parametrize("stride", [1, 64])
def test_a_long_prompts_fingerprints_follow_their_definition(stride: int) -> None:
    """Past a few dozen blocks the rolling hash is computed in numpy (mod 2**64 by the
    multiplier's inverse): the same fingerprints, negative tokens and one-token blocks too."""
    rng = np.random.default_rng(7)
    array = rng.integers(-(2**31), 2**31, 20_000, dtype=np.int32)
    policy = CandidatePolicy(min_tokens=stride, stride_tokens=stride, page_size_tokens=stride)
    grid = GridFingerprints(array, policy)
    assert len(grid.counts) > 200
    for index in (0, 1, 2, len(grid.counts) // 2, len(grid.counts) - 2, len(grid.counts) - 1):
        count = grid.counts[index]
        assert grid.prints[index] == _definition(array, count, stride)


def test_equal_prefixes_have_equal_fingerprints_across_prompts() -> None:
    """Two prompts sharing their first 300 tokens agree on every grid length within them and
    (almost surely) differ past it: the filter never hides a resident prefix."""
    policy = CandidatePolicy(min_tokens=64, stride_tokens=64)
    rng = np.random.default_rng(3)
    shared = rng.integers(0, 50_000, size=300, dtype=np.int32)
    one = np.concatenate([shared, rng.integers(0, 50_000, size=200, dtype=np.int32)])
    two = np.concatenate([shared, rng.integers(0, 50_000, size=100, dtype=np.int32)])
    first, second = GridFingerprints(one, policy), GridFingerprints(two, policy)
    mine = dict(zip(first.counts, first.prints, strict=True))
    theirs = dict(zip(second.counts, second.prints, strict=True))
    for count in set(mine) & set(theirs):
        assert (mine[count] == theirs[count]) == (count <= 300)


def test_stages_share_one_grid_per_prompt_array() -> None:
    """The same read-only array and grid give the same object; another array a new one."""
    policy = CandidatePolicy(min_tokens=8, stride_tokens=8)
    other_policy = CandidatePolicy(min_tokens=8, stride_tokens=8, record_limit=1)
    tokens = np.arange(100, dtype=np.int32)
    tokens.flags.writeable = False
    grid = grid_fingerprints(tokens, policy)
    assert grid_fingerprints(tokens, other_policy) is grid  # same grid, other ladder
    assert grid_fingerprints(tokens.copy(), policy) is not grid


def test_stages_that_record_alike_share_one_record_ladder_per_prompt() -> None:
    """The record ladder is computed once per grid for every policy with the same record limit
    and token budget, and apart for another limit; each is the policy's own answer."""
    tokens = np.arange(5000, dtype=np.int32)
    tokens.flags.writeable = False
    policy = CandidatePolicy(min_tokens=64, stride_tokens=64, record_limit=3)
    alike = CandidatePolicy(min_tokens=64, stride_tokens=64, record_limit=3)
    other = CandidatePolicy(min_tokens=64, stride_tokens=64, record_limit=2)
    grid = grid_fingerprints(tokens, policy)
    assert grid_fingerprints(tokens, other) is grid
    ladder = grid.ladder(policy)
    assert ladder == policy.record_candidate_token_counts(5000)
    assert grid.ladder(alike) is ladder
    assert grid.ladder(other) == other.record_candidate_token_counts(5000) != ladder


def test_lengths_of_one_prompt_keep_their_own_fingerprints() -> None:
    """Each grid length has its own fingerprint, even where the rolling hashes of two lengths
    are equal (leading blocks of zero tokens all hash to 0: the length is part of it), and an
    entry at the longer one is found."""
    policy = CandidatePolicy(min_tokens=8, stride_tokens=8)
    tokens = np.concatenate(
        [np.zeros(32, dtype=np.int32), np.arange(1, 17, dtype=np.int32), np.ones(3, np.int32)]
    )
    grid = GridFingerprints(tokens, policy)
    assert not grid.shared_prints
    assert len(set(grid.prints)) == len(grid.counts)
    assert grid.among({grid.prints[grid.position(32)]: 1}) == [32]

    cache = _ladder_cache(8)
    base = MessageBase(stage_id="stage-0")
    frame = ActivationFrame.virtual(token_count=32, bytes_per_token=8, fill=1)
    cache.record(base, tokens[:32].copy(), 2, frame)
    restore = cache.restore(base, tokens, 2)
    assert restore is not None
    assert restore.token_count == 32


def test_a_prefix_differing_only_in_unsampled_tokens_shares_a_fingerprint_but_never_hits() -> None:
    """The fingerprint reads a sample of each block, so a prompt that differs from a resident
    one only in an unsampled token passes the filter; its key then tells it apart: a miss,
    counted as never seen, and the resident entry still hits for its own prompt."""
    policy = CandidatePolicy(min_tokens=512, stride_tokens=512)
    rng = np.random.default_rng(5)
    first = rng.integers(0, 50_000, size=1024, dtype=np.int32)
    second = first.copy()
    second[0] += 1  # position 0 is not sampled (the last two of each block are)
    assert GridFingerprints(first, policy).prints == GridFingerprints(second, policy).prints

    cache = _ladder_cache(512)
    base = MessageBase(stage_id="stage-0")
    frame = ActivationFrame.virtual(token_count=1024, bytes_per_token=8, fill=1)
    cache.record(base, first, 2, frame)
    assert cache.restore(base, second, 2) is None
    assert cache.last_miss_reason == "never_seen"
    hit = cache.restore(base, first, 2)
    assert hit is not None
    assert hit.token_count == 1024


def test_a_prompt_whose_lengths_share_a_fingerprint_checks_every_length(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Should two lengths of one prompt ever share a fingerprint, the filter lets through every
    length with a resident fingerprint rather than one of them: a shorter entry is still
    found, and the restore and record go on as usual."""
    from stage_runtime.cache import prompt

    monkeypatch.setattr(
        prompt, "_prefix_fingerprints", lambda tokens, counts, stride: [7] * len(counts)
    )
    policy = CandidatePolicy(min_tokens=8, stride_tokens=8)
    tokens = np.arange(1, 36, dtype=np.int32)
    grid = GridFingerprints(tokens, policy)
    assert grid.shared_prints
    assert grid.among({7: 1}) == grid.counts
    assert grid.among({8: 1}) == []

    cache = _ladder_cache(8)
    base = MessageBase(stage_id="stage-0")
    cache.record(
        base,
        tokens[:16].copy(),
        2,
        ActivationFrame.virtual(token_count=16, bytes_per_token=8, fill=1),
    )
    restore = cache.restore(base, tokens, 2)
    assert restore is not None
    assert restore.token_count == 16
