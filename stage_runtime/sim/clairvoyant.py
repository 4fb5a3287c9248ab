"""The clairvoyant ceiling: what a cache of a given capacity could restore with perfect foresight.

The theoretical maximum (:mod:`stage_runtime.sim.theory`) is an infinite cache. At a finite
capacity the reference is Belady's policy: when the cache overflows, evict the page whose next
use is furthest in the future. It is optimal for pages of equal size, and it tells how much of
the distance to the infinite cache is *capacity* (infinite minus clairvoyant) and how much is
*policy* (clairvoyant minus what the replayed cache achieved). It is a reference for this
model of the cache, not a proof about every policy.

The model, at the replay's block size:

- a page is a block of a prompt, keyed by its prefix chain (the block ids of blocks ``0..i``),
  as in the theoretical maximum; every page takes one slot, a partial last page too; the
  capacity in pages is the capacity in tokens divided by the block size (rounded down; at least
  one page), and a capacity of 0 is unbounded;
- a request restores its leading pages while they are resident, each for the tokens of its block
  that earlier requests used since the page was admitted (at most what this request uses), and
  stops at the first page that is missing or was seen with fewer tokens (as the theoretical
  maximum does, so the unbounded figure equals it);
- after a request, all its pages are resident; while the cache holds more pages than its
  capacity, the resident page whose next use is furthest away goes (never used again counts as
  furthest; ties: the deeper page first). A page is used no later than its descendants, so the
  cache stays prefix-closed.

Next uses come from the workload's page table (:mod:`stage_runtime.sim.pages`) sorted by page
(:func:`plan`), what a backward pass over the requests gives; each capacity is then one forward
pass with a heap (:func:`clairvoyant_hits`), but for the unbounded cache, which evicts nothing:
its figure is the theoretical maximum's, computed in numpy. Requests are taken in the replay's
admission order.
"""

from __future__ import annotations

import array
import heapq
from collections.abc import Iterable, Sequence
from typing import Final

import attrs
import numpy as np
import numpy.typing as npt

from stage_runtime._validators import check_int
from stage_runtime.errors import ConfigError, shown
from stage_runtime.sim.pages import page_table, same_workload
from stage_runtime.sim.theory import restorable_tokens
from stage_runtime.sim.trace import SimRequest

__all__ = ["ClairvoyantPlan", "ClairvoyantResult", "clairvoyant_hits", "plan", "plan_of"]

_NEVER: Final = 1 << 62
"""The next use of a page no later request uses."""


@attrs.frozen(kw_only=True)
class ClairvoyantResult:
    """Tokens a clairvoyant cache of ``capacity_pages`` pages would restore."""

    capacity_pages: int
    """Pages the cache holds (0: unbounded)."""

    hit_tokens: int
    """Prompt tokens restored."""

    prompt_tokens: int
    """All prompt tokens."""

    @property
    def ratio(self) -> float:
        """``hit_tokens / prompt_tokens`` (0 for an empty workload)."""
        return self.hit_tokens / self.prompt_tokens if self.prompt_tokens else 0.0


@attrs.frozen(kw_only=True, eq=False)
class ClairvoyantPlan:
    """A workload's pages and their next uses: what every capacity's pass reads.

    Flat 64-bit arrays (a request's blocks are ``offsets[i]:offsets[i + 1]``): the plan of a
    long trace stays a few megabytes."""

    offsets: array.array[int]
    """Where each request's blocks start in the flat arrays (one more entry: the end)."""

    pages: array.array[int]
    """The page of each block (ids numbered in order of first use)."""

    used: array.array[int]
    """The tokens each block uses."""

    next_use: array.array[int]
    """The index of the next request that uses each block's page (or a value beyond every
    request)."""

    prompt_tokens: int
    """All prompt tokens."""


def plan(requests: Iterable[SimRequest], *, block_size: int) -> ClairvoyantPlan:
    """The pages of ``requests`` (in replay order) and their next uses.

    Raises:
        ConfigError: ``block_size`` is not an integer in ``[4, 1,048,576]``, or a request's
            ``block_lengths`` hold a length outside ``[0, block_size]``.
    """
    table = page_table(requests, block_size=block_size)
    pages, requests_of = table.pages, table.request_of_block()
    # A page is used at most once per request (its chain fixes its depth): sorted by page,
    # then request, each block's next use is the request of the block after it, if that
    # block has the same page.
    order = np.lexsort((requests_of, pages))
    same = pages[order[1:]] == pages[order[:-1]]
    next_use = np.full(len(pages), _NEVER, dtype=np.int64)
    next_use[order[:-1][same]] = requests_of[order[1:][same]]
    return ClairvoyantPlan(
        offsets=_flat(table.offsets),
        pages=_flat(pages),
        used=_flat(table.used),
        next_use=_flat(next_use),
        prompt_tokens=table.prompt_tokens,
    )


def _flat(values: npt.NDArray[np.int64]) -> array.array[int]:
    """``values`` as a 64-bit ``array.array`` (what the forward pass indexes fastest)."""
    flat = array.array("q")
    flat.frombytes(values.astype(np.int64, copy=False).tobytes())
    return flat


_last_plan: tuple[tuple[SimRequest, ...], int, ClairvoyantPlan] | None = None


def plan_of(requests: Sequence[SimRequest], *, block_size: int) -> ClairvoyantPlan:
    """:func:`plan`, remembered for the last workload (the same request objects in the same
    order, and block size): the replays of a sweep, or a benchmark's repeats, share it."""
    global _last_plan
    last = _last_plan
    if last is not None and same_workload(last[0], last[1], requests, block_size):
        return last[2]
    workload = plan(requests, block_size=block_size)
    _last_plan = (tuple(requests), block_size, workload)
    return workload


def capacity_pages(capacity_tokens: int, block_size: int) -> int:
    """Pages a capacity of ``capacity_tokens`` holds (0 stays 0: unbounded; else at least 1)."""
    if capacity_tokens <= 0:
        return 0
    return max(capacity_tokens // block_size, 1)


def clairvoyant_hits(workload: ClairvoyantPlan, capacity: int) -> ClairvoyantResult:
    """Replay ``workload`` through a clairvoyant cache of ``capacity`` pages (0: unbounded).

    Raises:
        ConfigError: ``capacity`` is not an integer >= 0.
    """
    capacity = check_int("capacity", capacity, low=0)
    if not capacity:  # nothing is evicted: the theoretical maximum, computed in numpy
        return ClairvoyantResult(
            capacity_pages=0,
            hit_tokens=restorable_tokens(
                np.frombuffer(workload.pages, dtype=np.int64),
                np.frombuffer(workload.used, dtype=np.int64),
                np.frombuffer(workload.offsets, dtype=np.int64),
            ),
            prompt_tokens=workload.prompt_tokens,
        )
    resident: dict[int, int] = {}
    """Resident page -> its next use."""
    seen: dict[int, int] = {}
    """Resident page -> the most tokens of its block a request used since it was admitted."""
    heap: list[tuple[int, int, int]] = []
    """(-next use, -depth, page): the furthest next use first, the deeper page on a tie; items
    whose next use is no longer the page's are skipped."""
    hit_tokens = 0
    offsets = workload.offsets
    for index in range(len(offsets) - 1):
        start, end = offsets[index], offsets[index + 1]
        chain = workload.pages[start:end]
        tokens = workload.used[start:end]
        following = workload.next_use[start:end]
        for page, count in zip(chain, tokens, strict=True):
            known = seen.get(page)
            if known is None:
                break
            hit_tokens += min(count, known)
            if known < count:
                break
        for depth, (page, count, use) in enumerate(zip(chain, tokens, following, strict=True)):
            if seen.get(page, -1) < count:
                seen[page] = count
            resident[page] = use
            heapq.heappush(heap, (-use, -depth, page))
        while len(resident) > capacity:
            use, _, page = heapq.heappop(heap)
            if resident.get(page) == -use:
                del resident[page]
                del seen[page]
    return ClairvoyantResult(
        capacity_pages=capacity, hit_tokens=hit_tokens, prompt_tokens=workload.prompt_tokens
    )


def clairvoyant_for(
    requests: Sequence[SimRequest], *, block_size: int, capacities_tokens: Iterable[int]
) -> dict[int, ClairvoyantResult]:
    """The clairvoyant result at each capacity in tokens (one backward pass in all).

    Args:
        requests: The workload, in replay order.
        block_size: Tokens per block id, and per page of the clairvoyant cache: an integer in
            ``[4, 1,048,576]``, as ``SimConfig.block_size``.
        capacities_tokens: Capacities in tokens, each an integer >= 0 (0: unbounded, as
            ``--sweep-capacity`` spells it); a capacity holds ``capacity // block_size`` pages,
            at least one.

    Returns:
        The result at each capacity, keyed by the capacity.

    Raises:
        ConfigError: ``block_size`` or a capacity is out of range (checked before any work), or
            a request's ``block_lengths`` hold a length outside ``[0, block_size]``.
    """
    if isinstance(capacities_tokens, str | bytes) or not isinstance(capacities_tokens, Iterable):
        msg = f"capacities_tokens must be an iterable of integers, got {shown(capacities_tokens)}"
        raise ConfigError(msg)
    capacities = [
        check_int(f"capacities_tokens[{position}]", capacity, low=0)
        for position, capacity in enumerate(capacities_tokens)
    ]
    workload = plan(requests, block_size=block_size)
    return {
        capacity: clairvoyant_hits(workload, capacity_pages(capacity, block_size))
        for capacity in capacities
    }
