"""The theoretical maximum hit ratio: an infinite cache at block granularity."""

from __future__ import annotations

import re

import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from stage_runtime import ConfigError
from stage_runtime.sim import (
    MAX_BLOCK_SIZE,
    MIN_BLOCK_SIZE,
    BlockTokenizer,
    SimRequest,
    theoretical_max_hit_ratio,
)


def _request(index: int, ids: list[int], length: int) -> SimRequest:
    return SimRequest(index=index, input_length=length, block_ids=tuple(ids))


def test_hand_computed_trace() -> None:
    """Worked by hand: shared chains hit, partial blocks count their seen part, then stop."""
    requests = [
        _request(0, [1, 2, 3], 1500),  # blocks 512, 512, 476: all new -> 0
        _request(1, [1, 2, 4], 1200),  # 1, 2 seen in full -> 1024; 4 new
        _request(2, [1, 2, 3], 1536),  # 1024 + 476 of block 3 (seen partly) -> 1500
        _request(3, [9, 2], 1024),  # 2 after a different chain is a different block -> 0
        _request(4, [5], 10),  # new -> 0
    ]
    result = theoretical_max_hit_ratio(requests, block_size=512)
    assert result.prompt_tokens == 1500 + 1200 + 1536 + 1024 + 10
    assert result.hit_tokens == 1024 + 1500
    assert result.ratio == 2524 / 5270


def test_repeating_a_prompt_restores_all_of_it() -> None:
    """The second identical prompt is entirely restorable."""
    requests = [_request(0, [1, 2], 700), _request(1, [1, 2], 700)]
    assert theoretical_max_hit_ratio(requests, block_size=512).hit_tokens == 700


def test_explicit_block_lengths_count_partial_blocks_mid_prompt() -> None:
    """A shared 3-token partial block followed by different blocks counts those 3 tokens."""
    requests = [
        SimRequest(index=0, input_length=7, block_ids=(1, 2), block_lengths=(3, 4)),
        SimRequest(index=1, input_length=7, block_ids=(1, 3), block_lengths=(3, 4)),
    ]
    result = theoretical_max_hit_ratio(requests, block_size=8)
    assert result.hit_tokens == 3


def test_empty_workload_has_ratio_zero() -> None:
    """No requests: zero tokens, ratio 0."""
    result = theoretical_max_hit_ratio([], block_size=512)
    assert (result.hit_tokens, result.prompt_tokens, result.ratio) == (0, 0, 0.0)


def test_signed_and_unsigned_spellings_of_an_id_are_one_block() -> None:
    """Ids are 64-bit values: -1 and 2^64 - 1 name the same block, for the token blocks (taken
    modulo 2^64) and for the maximum alike, so a replay can never beat the maximum."""
    requests = [_request(0, [-1, 5], 1024), _request(1, [2**64 - 1, 5], 1024)]
    assert theoretical_max_hit_ratio(requests, block_size=512).hit_tokens == 1024
    tokenizer = BlockTokenizer(512)
    assert (tokenizer.block(-1) == tokenizer.block(2**64 - 1)).all()


def test_numpy_integer_ids_are_accepted() -> None:
    """Ids given as numpy integers (the library API takes any integers) count like ints."""
    requests = [_request(0, list(np.array([1, 2], dtype=np.int64)), 1024)] * 2
    assert theoretical_max_hit_ratio(requests, block_size=512).hit_tokens == 1024


_TWICE = [_request(0, [1, 2], 8), _request(1, [1, 2], 8)]
"""A prompt that fits two blocks of any allowed size, then its repeat."""


@settings(max_examples=100, deadline=None)
@given(block_size=st.integers(-(2**21), 2**21))
@example(block_size=0)
@example(block_size=-1)
@example(block_size=-512)
@example(block_size=MIN_BLOCK_SIZE - 1)
@example(block_size=MIN_BLOCK_SIZE)
@example(block_size=MAX_BLOCK_SIZE)
@example(block_size=MAX_BLOCK_SIZE + 1)
def test_block_size_has_the_simulation_bounds(block_size: int) -> None:
    """A block size in [4, 1,048,576] (SimConfig's and --block-size's bounds) gives the maximum;
    any other integer is a ConfigError naming it (0 was a ZeroDivisionError, -512 a KeyError,
    -1 a silent 0)."""
    if MIN_BLOCK_SIZE <= block_size <= MAX_BLOCK_SIZE:
        result = theoretical_max_hit_ratio(_TWICE, block_size=block_size)
        assert (result.hit_tokens, result.prompt_tokens) == (8, 16)
        return
    message = rf"^block_size must be an integer in \[4, 1,048,576\], got {block_size}$"
    with pytest.raises(ConfigError, match=message):
        theoretical_max_hit_ratio(_TWICE, block_size=block_size)


@pytest.mark.parametrize("block_size", [512.0, 1.5, "512", None, True])
def test_a_block_size_that_is_not_an_integer_is_refused(block_size: object) -> None:
    """A float, a string, None or a bool is named, not a TypeError from inside numpy."""
    message = (
        rf"block_size must be an integer in \[4, 1,048,576\], got {re.escape(repr(block_size))}"
    )
    with pytest.raises(ConfigError, match=message):
        theoretical_max_hit_ratio(_TWICE, block_size=block_size)  # type: ignore[arg-type]
