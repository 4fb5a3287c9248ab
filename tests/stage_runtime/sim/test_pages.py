"""The page table the theoretical maximum and the clairvoyant ceiling share, checked against
the walks they replaced (a dict of chains per block, one request at a time)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from stage_runtime.errors import ConfigError
from stage_runtime.sim import SimRequest, theoretical_max_hit_ratio
from stage_runtime.sim.clairvoyant import clairvoyant_hits, plan
from stage_runtime.sim.pages import page_table

BLOCK = 4
_NEVER = 1 << 62


def _walk(requests: list[SimRequest]) -> tuple[list[int], list[int], list[int]]:
    """Pages numbered by first use, tokens used and request offsets, one block at a time."""
    nodes: dict[tuple[int, int], int] = {}
    pages: list[int] = []
    used: list[int] = []
    offsets = [0]
    for request in requests:
        parent = -1
        for block_id, count in request.block_layout(BLOCK):
            key = (parent, int(block_id) % 2**64)
            parent = nodes.setdefault(key, len(nodes))
            pages.append(parent)
            used.append(count)
        offsets.append(len(pages))
    return pages, used, offsets


def _next_uses(pages: list[int], offsets: list[int]) -> list[int]:
    later: dict[int, int] = {}
    next_use = [0] * len(pages)
    for index in range(len(offsets) - 2, -1, -1):
        span = range(offsets[index], offsets[index + 1])
        for position in span:
            next_use[position] = later.get(pages[position], _NEVER)
        for position in span:
            later[pages[position]] = index
    return next_use


def _maximum(requests: list[SimRequest]) -> int:
    """The theoretical maximum's definition: restore while seen, stop after the first block
    used more than seen."""
    pages, used, offsets = _walk(requests)
    seen: dict[int, int] = {}
    hit = 0
    for index in range(len(offsets) - 1):
        restoring = True
        for position in range(offsets[index], offsets[index + 1]):
            page, count = pages[position], used[position]
            if restoring:
                known = seen.get(page, 0)
                hit += min(count, known)
                restoring = known >= count
            seen[page] = max(seen.get(page, 0), count)
    return hit


_ids = st.sampled_from([1, 2, 3, -1, 2**64 - 1, 2**63, 7])


@st.composite
def _workloads(draw: st.DrawFn) -> list[SimRequest]:
    requests = []
    for index in range(draw(st.integers(0, 12))):
        ids = tuple(draw(st.lists(_ids, min_size=1, max_size=6)))
        if draw(st.booleans()):
            # (more tokens than the blocks hold too: the walk takes the blocks there are)
            length = draw(st.integers(1, BLOCK * len(ids) + BLOCK))
            requests.append(SimRequest(index=index, input_length=length, block_ids=ids))
        else:
            lengths = tuple(draw(st.integers(0, BLOCK)) for _ in ids)
            total = sum(lengths)
            if total == 0:
                continue
            requests.append(
                SimRequest(index=index, input_length=total, block_ids=ids, block_lengths=lengths)
            )
    return requests


@settings(max_examples=300, deadline=None)
@given(_workloads())
def test_the_page_table_equals_a_walk_of_the_chains(requests: list[SimRequest]) -> None:
    """Pages (numbered by first use, -1 and 2^64 - 1 one id), tokens used and offsets are
    what a block-by-block walk gives, and so are the next uses and the theoretical maximum."""
    pages, used, offsets = _walk(requests)
    table = page_table(requests, block_size=BLOCK)
    assert table.pages.tolist() == pages
    assert table.used.tolist() == used
    assert table.offsets.tolist() == offsets
    assert table.prompt_tokens == sum(request.input_length for request in requests)
    workload = plan(requests, block_size=BLOCK)
    assert workload.next_use.tolist() == _next_uses(pages, offsets)
    assert theoretical_max_hit_ratio(requests, block_size=BLOCK).hit_tokens == _maximum(requests)
    # Unbounded, the ceiling is the maximum.
    assert clairvoyant_hits(workload, 0).hit_tokens == _maximum(requests)


def test_an_empty_workload_has_an_empty_table() -> None:
    """No requests: one offset, no pages."""
    table = page_table([], block_size=BLOCK)
    assert (table.offsets.tolist(), table.pages.tolist(), table.requests) == ([0], [], 0)
    assert len(plan([], block_size=BLOCK).next_use) == 0


def test_block_lengths_outside_a_block_are_config_errors() -> None:
    """A hand-built request whose explicit lengths do not fit a block is refused, naming it
    (replays refuse it earlier, in their request checks)."""
    bad = SimRequest(index=7, input_length=2, block_ids=(1, 2), block_lengths=(-1, 3))
    with pytest.raises(ConfigError, match=r"request 7: block_lengths must lie in \[0, 4\]"):
        page_table([bad], block_size=BLOCK)
    with pytest.raises(ConfigError, match="request 7"):
        theoretical_max_hit_ratio([bad], block_size=BLOCK)
