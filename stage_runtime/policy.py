"""Which prefix lengths a stage looks up and records (spec §2).

Lookups probe a stride-aligned grid of prefix lengths, longest first; records store a short
"ladder" of them: the exact length, the longest grid length below it (the near-tail page that an
extended prompt will find), and, for limits above 2, rungs spaced geometrically between
``min_tokens`` and the prompt length within an optional token budget.
"""

from __future__ import annotations

import math
from typing import Any

import attrs

from stage_runtime._validators import check_int, check_non_negative_int
from stage_runtime.config import KvCacheConfig
from stage_runtime.errors import ConfigError
from stage_runtime.limits import U64_MAX as _U64_MAX

__all__ = [
    "CandidatePolicy",
    "derive_max_resident_tokens",
    "round_half_away_from_zero",
]


def _count(_instance: object, attribute: attrs.Attribute[Any], value: object) -> None:
    if check_non_negative_int(attribute.name, value) > _U64_MAX:
        check_int(attribute.name, value, low=0, high=_U64_MAX)


def round_half_away_from_zero(value: float) -> int:
    """Round like Rust's ``f64::round`` (2.5 -> 3, -2.5 -> -3), unlike Python's ``round``."""
    # Not floor(|x| + 0.5): that sum rounds itself (0.49999999999999994 + 0.5 == 1.0).
    magnitude = abs(value)
    whole = math.floor(magnitude)
    if magnitude - whole >= 0.5:
        whole += 1
    return int(math.copysign(whole, value))


def derive_max_resident_tokens(ctx_size: int) -> int:
    """The record-ladder token budget for a context size (spec §6.2, V-A..V-D variant).

    0 (no budget) below 8,192 tokens of context, else half the context.
    """
    if ctx_size < 8192:
        return 0
    return ctx_size // 2


def _check_n(token_count: object, name: str = "token_count") -> int:
    return check_non_negative_int(name, token_count)


@attrs.frozen(kw_only=True)
class CandidatePolicy:
    """The lookup grid and record ladder (the upstream's ``SparseCheckpointPolicy``)."""

    min_tokens: int = attrs.field(default=64, validator=_count)
    """Shortest prefix considered; 0 makes every candidate list exact-only."""

    stride_tokens: int = attrs.field(default=128, validator=_count)
    """Grid spacing before capping at ``page_size_tokens`` (0 acts as 1)."""

    record_limit: int = attrs.field(default=2, validator=_count)
    """Lengths one record stores; 0 means all lookup candidates."""

    page_size_tokens: int = attrs.field(default=64, validator=_count)
    """Caps the stride; ``max(min_tokens, 1)`` when built from a cache config."""

    max_resident_tokens_hint: int = attrs.field(default=0, validator=_count)
    """Token budget of the geometric rungs (limits above 2); 0 means no budget."""

    _stride: int = attrs.field(init=False, repr=False, eq=False)
    """:attr:`effective_stride`, computed once (the policy is frozen)."""

    def __attrs_post_init__(self) -> None:
        stride = min(max(self.stride_tokens, 1), max(self.page_size_tokens, 1))
        object.__setattr__(self, "_stride", stride)

    @classmethod
    def from_cache_config(cls, cfg: KvCacheConfig) -> CandidatePolicy:
        """The policy of a cache configuration, with no token budget (hint 0)."""
        return cls(
            min_tokens=cfg.min_tokens,
            stride_tokens=cfg.shared_prefix_stride_tokens,
            record_limit=cfg.shared_prefix_record_limit,
            page_size_tokens=max(cfg.min_tokens, 1),
        )

    @property
    def effective_stride(self) -> int:
        """The grid spacing actually used: the stride capped at the page size, at least 1."""
        return self._stride

    def candidate_token_counts(self, token_count: int) -> list[int]:
        """Prefix lengths to look up for an N-token prompt, longest first (spec §2.1).

        ``[N]`` when N is at most ``min_tokens`` (or ``min_tokens`` is 0), else N followed by the
        grid floor below N and every grid line down to ``min_tokens``.

        Raises:
            ConfigError: ``token_count`` is not an integer >= 0.
        """
        n = _check_n(token_count)
        low = self.min_tokens
        if n == 0:
            return []
        if low == 0 or n <= low:
            return [n]
        stride = self._stride
        top = n - n % stride
        if top == n:
            top = n - stride
        top = max(top, low)
        return [n, *range(top, low, -stride), low]

    def candidate_count(self, token_count: int) -> int:
        """``len(candidate_token_counts(token_count))``, in O(1).

        Raises:
            ConfigError: ``token_count`` is not an integer >= 0.
        """
        n = _check_n(token_count)
        low = self.min_tokens
        if n == 0:
            return 0
        if low == 0 or n <= low:
            return 1
        # n, then the grid lines top, top - stride, ... above low (ceil((top - low) / stride) of
        # them), then low itself.
        grid_lines = -(-(self._top(n) - low) // self._stride)
        return 2 + grid_lines

    def candidate_index(self, token_count: int, count: int) -> int:
        """Position of ``count`` in ``candidate_token_counts(token_count)``, in O(1).

        Raises:
            ConfigError: ``token_count`` or ``count`` is not an integer >= 0, or ``count`` is not
                a candidate length of ``token_count``.
        """
        _check_n(token_count)
        _check_n(count, "count")
        if not self.is_candidate(token_count, count):
            msg = f"{count!r} is not a candidate length of a {token_count!r}-token prompt"
            raise ConfigError(msg)
        if count == token_count:
            return 0
        if count == self.min_tokens:
            return self.candidate_count(token_count) - 1
        return 1 + (self._top(token_count) - count) // self._stride

    def _top(self, n: int) -> int:
        """The longest grid line below ``n`` (at least ``min_tokens``); needs n > min_tokens."""
        stride = self._stride
        top = n - n % stride
        if top == n:
            top = n - stride
        return max(top, self.min_tokens)

    def is_candidate(self, token_count: int, count: int) -> bool:
        """Whether ``count`` is in ``candidate_token_counts(token_count)``, in O(1)."""
        n = token_count
        if n <= 0 or count <= 0 or count > n:
            return False
        if count == n:
            return True
        low = self.min_tokens
        if low == 0 or n <= low or count < low:
            return False
        if count == low:
            return True
        stride = self._stride
        top = n - n % stride
        if top == n:
            top = n - stride
        return count <= top and (top - count) % stride == 0

    def record_candidate_token_counts(self, token_count: int) -> list[int]:
        """Prefix lengths to record for an N-token prompt, longest first (spec §2.2).

        Raises:
            ConfigError: ``token_count`` is not an integer >= 0.
        """
        limit = self.record_limit
        if limit in (1, 2):
            # The exact length and the longest grid line below it: no need to list the grid.
            n = _check_n(token_count)
            if n == 0:
                return []
            if limit == 1 or self.min_tokens == 0 or n <= self.min_tokens:
                return [n]
            return [n, self._top(n)]
        candidates = self.candidate_token_counts(token_count)
        if limit == 0 or len(candidates) <= limit:
            return candidates
        n = candidates[0]
        if limit == 1:
            return [n]
        shared = candidates[1:]
        selected = [n, shared[0]]
        taken = {shared[0]}
        pinned = 0
        hint = self.max_resident_tokens_hint
        for target in self._geometric_targets(n, limit - 2):
            if len(selected) >= limit:
                break
            pick = None
            best = 0
            for value in shared:  # descending: on a tie the larger value stays
                if value in taken:
                    continue
                distance = abs(value - target)
                if pick is None or distance < best:
                    pick, best = value, distance
            if pick is None:
                break
            if hint > 0 and pinned + pick > hint:
                break
            pinned += pick
            taken.add(pick)
            selected.append(pick)
        return sorted(set(selected), reverse=True)

    def _geometric_targets(self, n: int, slots: int) -> list[int]:
        if slots <= 0:
            return []
        floor = min(max(self.min_tokens, 1), max(n, 1))
        ceiling = max(n, 1)
        if ceiling <= floor:
            return [self.min_tokens]
        ratio = ceiling / floor
        return [
            max(round_half_away_from_zero(floor * ratio ** (i / (slots + 1))), 1)
            for i in range(1, slots + 1)
        ]
