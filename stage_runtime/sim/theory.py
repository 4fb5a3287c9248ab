"""The best any prefix cache could do on a workload: an infinite cache at block granularity."""

from __future__ import annotations

from collections.abc import Iterable

import attrs

# Block ids are 64-bit values, signed or unsigned (BlockTokenizer takes them modulo 2^64).
from stage_runtime.limits import U64_MAX as _ID_MASK
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
        block_size: Tokens per block id (needed for trace requests with implicit lengths).

    Returns:
        The restorable and total prompt tokens.
    """
    seen: dict[tuple[int, int], int] = {}
    nodes: dict[tuple[int, int], int] = {}
    hit_tokens = 0
    prompt_tokens = 0
    for request in requests:
        prompt_tokens += request.input_length
        parent = -1
        restoring = True
        for block_id, used in request.block_layout(block_size):
            key = (parent, int(block_id) & _ID_MASK)  # as the token blocks: -1 is 2^64 - 1
            node = nodes.get(key)
            if node is None:
                node = len(nodes)
                nodes[key] = node
            if restoring:
                known = seen.get(key, 0)
                hit_tokens += min(used, known)
                restoring = known >= used
            if seen.get(key, 0) < used:
                seen[key] = used
            parent = node
    return TheoreticalMax(hit_tokens=hit_tokens, prompt_tokens=prompt_tokens)
