"""The best any prefix cache could do on a workload: an infinite cache at block granularity."""

from __future__ import annotations

from collections.abc import Iterable

import attrs
import numpy as np
import numpy.typing as npt

from stage_runtime.sim.pages import page_table
from stage_runtime.sim.trace import SimRequest

__all__ = ["TheoreticalMax", "theoretical_max_hit_ratio"]


@attrs.frozen(kw_only=True)
class TheoreticalMax:
    """Tokens an infinite block-granular prefix cache would restore."""

    hit_tokens: int
    """Prompt tokens covered by a block chain seen in an earlier request."""

    prompt_tokens: int
    """All prompt tokens."""

    @property
    def ratio(self) -> float:
        """``hit_tokens / prompt_tokens`` (0 for an empty workload)."""
        return self.hit_tokens / self.prompt_tokens if self.prompt_tokens else 0.0


def theoretical_max_hit_ratio(requests: Iterable[SimRequest], *, block_size: int) -> TheoreticalMax:
    """Count the prompt tokens an infinite prefix cache keyed by block chains would restore.

    The requests are taken in order. Block ``i`` of a request is a node of a trie keyed by the
    ids of blocks ``0..i``; a node remembers the most tokens of its block any earlier request
    used. A request restores its blocks front to back while the node exists, taking
    ``min(tokens it uses, tokens seen)`` of each, and stops at the first block it uses more of
    than was seen (the rest of its prompt is new). Then it adds its own blocks to the trie.
    Nothing is ever evicted, and restores are not restricted to a lookup grid: this is the upper
    bound for any cache of this workload, in particular for the activation cache.

    Args:
        requests: The workload in replay order.
        block_size: Tokens per block id (needed for trace requests with implicit lengths): an
            integer in ``[4, 1,048,576]``, as ``SimConfig.block_size``.

    Returns:
        The restorable and total prompt tokens.

    Raises:
        ConfigError: ``block_size`` is out of range, or a request's ``block_lengths`` hold a
            length outside ``[0, block_size]``.
    """
    table = page_table(requests, block_size=block_size)
    hit_tokens = restorable_tokens(table.pages, table.used, table.offsets)
    return TheoreticalMax(hit_tokens=hit_tokens, prompt_tokens=table.prompt_tokens)


def restorable_tokens(
    pages: npt.NDArray[np.int64], used: npt.NDArray[np.int64], offsets: npt.NDArray[np.int64]
) -> int:
    """The tokens an infinite cache restores of a page table (see
    :func:`theoretical_max_hit_ratio`): each block's page and the tokens it uses, request
    ``i``'s blocks being ``offsets[i]:offsets[i + 1]``."""
    if not len(pages):
        return 0
    # What earlier requests used of each block's page: a running maximum over the page's
    # blocks in request order (a page is used at most once per request), excluding the block
    # itself. Offsetting each page's values by page x (largest use + 1) lets one cumulative
    # maximum over all pages, sorted by page, run page by page.
    order = np.argsort(pages, kind="stable")
    by_page, used_sorted = pages[order], used[order]
    step = int(used.max()) + 1
    running = np.maximum.accumulate(by_page * step + used_sorted)
    later = np.flatnonzero(by_page[1:] == by_page[:-1]) + 1  # not a page's first block
    seen_sorted = np.zeros(len(pages), dtype=np.int64)
    seen_sorted[later] = running[later - 1] - by_page[later] * step
    seen = np.empty_like(seen_sorted)
    seen[order] = seen_sorted
    # A request restores its blocks front to back up to and including the first one it uses
    # more of than was seen.
    short = (seen < used).astype(np.int64)
    shorts = np.cumsum(short)
    starts = np.repeat(offsets[:-1], np.diff(offsets))
    before = np.where(starts > 0, shorts[starts - 1], 0)
    restoring = shorts - short - before == 0
    return int(np.minimum(used, seen)[restoring].sum())
