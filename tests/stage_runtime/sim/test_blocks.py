"""Hash ids become deterministic token blocks."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from stage_runtime import ConfigError
from stage_runtime.sim import MAX_BLOCK_SIZE, MIN_BLOCK_SIZE, VOCAB_SIZE, BlockTokenizer, SimRequest

_IDS = st.integers(min_value=-(2**63), max_value=2**63 - 1)


def test_block_depends_only_on_its_id() -> None:
    """Two tokenizers give the same block for the same id, wherever it sits in the prompt."""
    first, second = BlockTokenizer(512), BlockTokenizer(512)
    prompt = first.prompt([9, 42, 7], 1536)
    np.testing.assert_array_equal(prompt[512:1024], second.block(42))
    np.testing.assert_array_equal(first.block(42), second.block(42))


@settings(max_examples=200, deadline=None)
@given(a=_IDS, b=_IDS, block_size=st.sampled_from([4, 7, 100, 128, 512, 1000]))
def test_distinct_ids_give_distinct_blocks(a: int, b: int, block_size: int) -> None:
    """Distinct ids never give the same full block; equal ids always do."""
    tokenizer = BlockTokenizer(block_size)
    same = bool(np.array_equal(tokenizer.block(a), tokenizer.block(b)))
    assert same == (a == b)


def test_neighbouring_ids_differ_in_many_tokens() -> None:
    """Ids 0..999 give 1000 pairwise different blocks that differ in at least a quarter."""
    blocks = BlockTokenizer(512).blocks(np.arange(1000))
    assert len({row.tobytes() for row in blocks}) == 1000
    assert int((blocks[0] != blocks[1]).sum()) >= 128


def test_equal_chains_give_equal_prefixes_and_cut_to_length() -> None:
    """Prompts sharing their first ids share those tokens; lengths cut the last block."""
    tokenizer = BlockTokenizer(16)
    a = tokenizer.prompt([1, 2, 3], 40)
    b = tokenizer.prompt([1, 2, 4], 35)
    assert a.shape == (40,)
    assert b.shape == (35,)
    np.testing.assert_array_equal(a[:32], b[:32])
    assert not np.array_equal(a[32:35], b[32:35])


def test_tokens_are_int32_in_the_vocabulary() -> None:
    """Token ids are contiguous int32 values in [0, VOCAB_SIZE), down to the smallest blocks."""
    for block_size in (512, 100, MIN_BLOCK_SIZE):
        tokens = BlockTokenizer(block_size).prompt(list(range(50)), 50 * block_size - 1)
        assert tokens.dtype == np.int32
        assert tokens.flags.c_contiguous
        assert int(tokens.min()) >= 0
        assert int(tokens.max()) < VOCAB_SIZE


def test_explicit_block_lengths_place_partial_blocks_anywhere() -> None:
    """block_lengths take a prefix of each block, so a partial block can sit mid-prompt."""
    tokenizer = BlockTokenizer(8)
    tokens = tokenizer.prompt([5, 6], 11, block_lengths=[3, 8])
    np.testing.assert_array_equal(tokens[:3], tokenizer.block(5)[:3])
    np.testing.assert_array_equal(tokens[3:], tokenizer.block(6))
    request = SimRequest(index=0, input_length=11, block_ids=(5, 6), block_lengths=(3, 8))
    np.testing.assert_array_equal(tokenizer.request_tokens(request), tokens)


@pytest.mark.parametrize(
    ("ids", "length", "lengths", "message"),
    [
        ([1], 9, None, "input_length must be <= block_size \\* len\\(block_ids\\) = 8, got 9"),
        ([1, 2], 3, [3], "block_lengths must have one entry per block id"),
        ([1], 9, [9], "block_lengths must lie in \\[0, 8\\]"),
        ([1, 2], 5, [3, 3], "block_lengths must sum to input_length 5, got 6"),
    ],
)
def test_inconsistent_prompts_are_refused(
    ids: list[int], length: int, lengths: list[int] | None, message: str
) -> None:
    """Lengths that do not fit the blocks raise ConfigError naming the field."""
    with pytest.raises(ConfigError, match=message):
        BlockTokenizer(8).prompt(ids, length, block_lengths=lengths)


@pytest.mark.parametrize(
    "block_size", [0, -512, MIN_BLOCK_SIZE - 1, MAX_BLOCK_SIZE + 1, 512.0, True, "512", None]
)
def test_block_size_outside_the_simulation_bounds_is_refused(block_size: object) -> None:
    """A block size that is not an integer in [4, 1,048,576] (SimConfig's bounds) is refused
    by name, before any block is generated: blocks of fewer than 4 tokens cannot keep distinct
    ids apart, and a huge one would exhaust memory instead of failing."""
    rule = r"block_size must be an integer in \[4, 1,048,576\], got "
    with pytest.raises(ConfigError, match=rule + repr(block_size).replace(".", r"\.")):
        BlockTokenizer(block_size)  # type: ignore[arg-type]


def test_unsigned_64_bit_ids_are_accepted() -> None:
    """Ids up to 2**64 - 1 (unsigned hashes) work; they are read modulo 2**64."""
    tokenizer = BlockTokenizer(16)
    np.testing.assert_array_equal(tokenizer.block(2**64 - 1), tokenizer.block(-1))
    assert not np.array_equal(tokenizer.block(2**63), tokenizer.block(2**63 + 1))
    prompt = tokenizer.prompt([2**63, 5], 20)
    np.testing.assert_array_equal(prompt[16:], tokenizer.block(5)[:4])


def test_each_request_tokens_gives_each_requests_own_prompt() -> None:
    """Mixed a chunk of requests at a time, the prompts are each request's own, in order:
    across chunks, cut blocks, ids beyond int64 and id lists that are not tuples (taken one
    request at a time) included."""
    rng = np.random.default_rng(7)
    tokenizer = BlockTokenizer(16)
    requests = []
    for index in range(600):
        count = int(rng.integers(1, 6))
        ids = tuple(int(i) for i in rng.integers(-(2**40), 2**40, count))
        lengths = None
        if index % 7 == 3:
            lengths = tuple(int(n) for n in rng.integers(1, 17, count))
            length = sum(lengths)
        else:
            length = int(rng.integers(1, 16 * count + 1))
        if index == 300:
            ids = (2**64 - 1, *ids[1:])  # (taken modulo 2**64, by the chunk's fallback)
        if index == 450:  # (a hand-built list, as SimRequest takes it unconverted)
            ids = list(ids)  # type: ignore[assignment]
        requests.append(
            SimRequest(index=index, input_length=length, block_ids=ids, block_lengths=lengths)
        )
    prompts = list(tokenizer.each_request_tokens(requests))
    assert len(prompts) == len(requests)
    for request, prompt in zip(requests, prompts, strict=True):
        expected = tokenizer.request_tokens(request)
        assert prompt.dtype == expected.dtype == np.int32
        np.testing.assert_array_equal(prompt, expected)


def test_each_request_tokens_refuses_a_prompt_when_it_is_reached() -> None:
    tokenizer = BlockTokenizer(16)
    good = SimRequest(index=0, input_length=20, block_ids=(1, 2))
    bad = SimRequest(index=1, input_length=40, block_ids=(3, 4))
    prompts = tokenizer.each_request_tokens([good, bad])
    np.testing.assert_array_equal(next(prompts), tokenizer.request_tokens(good))
    with pytest.raises(ConfigError, match=r"input_length must be <= block_size \* len"):
        next(prompts)
