"""A workload's blocks as pages of a prefix trie, numbered in whole-array passes.

The theoretical maximum (:mod:`stage_runtime.sim.theory`) and the clairvoyant ceiling
(:mod:`stage_runtime.sim.clairvoyant`) both see a request's blocks as pages keyed by their prefix
chain: block ``i`` of a request is the page ``(page of block i - 1, block id)``. A trace has
about 120,000 blocks; a Python loop over them with a dict of chains took about 70 ms per pass.
Here the chains are numbered one depth at a time with numpy (a request has at most a few hundred
blocks), so both figures cost a few milliseconds.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import attrs
import numpy as np
import numpy.typing as npt

from stage_runtime.errors import ConfigError
from stage_runtime.limits import U64_MAX
from stage_runtime.sim.trace import SimRequest, check_block_size

__all__ = ["PageTable", "page_table", "same_workload"]

_Ints = npt.NDArray[np.int64]


@attrs.frozen(kw_only=True, eq=False)
class PageTable:
    """Every block a workload's requests use, flat and in request order (a request's blocks
    are ``offsets[i]:offsets[i + 1]``)."""

    offsets: _Ints
    """Where each request's blocks start (one more entry: the end)."""

    pages: _Ints
    """The page of each block: pages are numbered in order of first use, so two blocks have
    the same page exactly when their chains of block ids (taken modulo 2^64) are equal."""

    used: _Ints
    """The tokens each block uses."""

    prompt_tokens: int
    """All prompt tokens."""

    @property
    def requests(self) -> int:
        """How many requests the table holds."""
        return len(self.offsets) - 1

    def request_of_block(self) -> _Ints:
        """The index of the request each block belongs to."""
        counts = np.diff(self.offsets)
        return np.repeat(np.arange(len(counts), dtype=np.int64), counts)


_last_table: tuple[tuple[SimRequest, ...], int, PageTable] | None = None


def same_workload(
    known: Sequence[SimRequest],
    known_block_size: int,
    requests: Sequence[SimRequest],
    block_size: int,
) -> bool:
    """Whether ``requests`` are the very request objects of ``known``, in the same order, at
    the same block size (what a memo of a workload's figures may be reused for)."""
    return (
        known_block_size == block_size
        and len(known) == len(requests)
        and all(a is b for a, b in zip(known, requests, strict=True))
    )


def page_table(requests: Iterable[SimRequest], *, block_size: int) -> PageTable:
    """The pages of ``requests`` (in the order given), each block as
    :meth:`SimRequest.block_layout` lays it out. Remembered for the last workload (the same
    request objects in the same order, and block size): a replay's theoretical maximum and its
    clairvoyant plan share one table. Its arrays are read-only.

    Raises:
        ConfigError: ``block_size`` is not an integer in ``[4, 1,048,576]`` (the bounds of
            ``SimConfig.block_size``), or a request's ``block_lengths`` hold a length outside
            ``[0, block_size]``.
    """
    global _last_table
    check_block_size(block_size)
    workload = tuple(requests)
    last = _last_table
    if last is not None and same_workload(last[0], last[1], workload, block_size):
        return last[2]
    table = _page_table(workload, block_size)
    _last_table = (workload, block_size, table)
    return table


def _page_table(requests: tuple[SimRequest, ...], block_size: int) -> PageTable:
    ids: list[int] = []
    explicit: list[int] = []
    counts: list[int] = []
    ends: list[int] = []  # tokens of a trace request's last block (-1: explicit lengths)
    prompt_tokens = 0
    for request in requests:
        prompt_tokens += request.input_length
        if request.block_lengths is None:
            used = -(-request.input_length // block_size)
            taken = request.block_ids[:used]
            ids.extend(taken)
            counts.append(len(taken))
            ends.append(request.input_length - block_size * (used - 1) if taken else -1)
        else:
            layout = request.block_layout(block_size)
            if any(not 0 <= count <= block_size for _, count in layout):
                msg = (
                    f"request {request.index}: block_lengths must lie in [0, {block_size}], "
                    f"got {list(request.block_lengths)}"
                )
                raise ConfigError(msg)
            ids.extend(block_id for block_id, _ in layout)
            explicit.extend(count for _, count in layout)
            counts.append(len(layout))
            ends.append(-1)
    count_array = np.asarray(counts, dtype=np.int64)
    offsets = np.zeros(len(counts) + 1, dtype=np.int64)
    np.cumsum(count_array, out=offsets[1:])
    total = int(offsets[-1])
    pages = _number_chains(_block_ids(ids), offsets, total)
    tokens = _used(count_array, offsets, np.asarray(ends, dtype=np.int64), explicit, block_size)
    for shared in (offsets, pages, tokens):
        shared.flags.writeable = False
    return PageTable(offsets=offsets, pages=pages, used=tokens, prompt_tokens=prompt_tokens)


def _block_ids(ids: list[int]) -> npt.NDArray[np.uint64]:
    """The ids as 64-bit values: -1 and 2^64 - 1 are one id, as for the token blocks."""
    try:
        return np.asarray(ids, dtype=np.int64).view(np.uint64)
    except OverflowError:  # ids beyond int64 (unsigned 64-bit hashes)
        return np.asarray([int(i) & U64_MAX for i in ids], dtype=np.uint64)


def _used(
    counts: _Ints, offsets: _Ints, ends: _Ints, explicit: list[int], block_size: int
) -> _Ints:
    """Tokens per block: whole blocks with the last one cut for trace requests, the given
    lengths for requests that have them."""
    used = np.full(int(offsets[-1]), block_size, dtype=np.int64)
    trace = ends >= 0
    used[offsets[1:][trace] - 1] = ends[trace]
    if explicit:
        mask = np.repeat(~trace, counts)
        used[mask] = explicit
    return used


def _number_chains(ids: npt.NDArray[np.uint64], offsets: _Ints, total: int) -> _Ints:
    """The page of each block: its chain (the page of the block before it in its request, and
    its own id) numbered in order of first use."""
    starts = np.repeat(offsets[:-1], np.diff(offsets))
    depth = np.arange(total, dtype=np.int64) - starts
    provisional = np.empty(total, dtype=np.int64)
    by_depth = np.argsort(depth, kind="stable")  # each depth's blocks, in request order
    level_ends = np.searchsorted(depth[by_depth], np.arange(1, int(depth.max(initial=-1)) + 2))
    numbered = 0
    begin = 0
    for end in level_ends.tolist():
        blocks = by_depth[begin:end]
        begin = end
        parents = provisional[blocks - 1] if numbered else np.full(len(blocks), -1, np.int64)
        own = ids[blocks]
        order = np.lexsort((own, parents))
        sorted_parents, sorted_own = parents[order], own[order]
        new = np.ones(len(blocks), dtype=bool)
        new[1:] = (sorted_parents[1:] != sorted_parents[:-1]) | (sorted_own[1:] != sorted_own[:-1])
        chain = np.cumsum(new) - 1 + numbered
        provisional[blocks[order]] = chain
        numbered += int(new.sum())
    # Renumber by first use (request order, then depth), as a walk of the requests would.
    first = np.full(numbered, total, dtype=np.int64)
    np.minimum.at(first, provisional, np.arange(total, dtype=np.int64))
    rank = np.empty(numbered, dtype=np.int64)
    rank[np.argsort(first, kind="stable")] = np.arange(numbered, dtype=np.int64)
    pages: _Ints = rank[provisional]
    return pages
