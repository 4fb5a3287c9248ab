"""One request as a stage cache sees it: validated once, hashed at most once.

A stage restores and then records the same prompt. A :class:`Prompt` carries what both need
(the stage, the envelope, the tokens, the width) and what they compute (the BLAKE3 prefix hashes,
the grid fingerprints), so the record reuses the restore's work. The tokens are a read-only array
nobody can change: the caller's own when it is read-only and owns its memory (what the pipeline
hands every stage), a private copy otherwise.

Grid fingerprints (:class:`GridFingerprints`) are cheap digests of the prefixes at the lookup
grid's lengths: a rolling hash of a sample of the tokens (the last two of each block of the
grid's stride, and every token after the last whole block), one pass over the samples.
They depend on the tokens and the grid only, so every stage of a pipeline shares one set per
request (:func:`grid_fingerprints` remembers the last few). They are a filter, never a key: equal
prefixes have equal fingerprints, so a prefix whose fingerprint is not among the resident ones
cannot be resident; a match is confirmed by the prefix's BLAKE3 key.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Mapping, Sequence
from typing import Final

import numpy as np
import numpy.typing as npt

from stage_runtime.config import MessageBase, StageConfig
from stage_runtime.identity import TokenArray, _frozen, _hash_counts, _prelude
from stage_runtime.policy import CandidatePolicy
from stage_runtime.tenancy import salted_prefix_hash

__all__ = ["GridFingerprints", "Prompt", "grid_fingerprints", "owned_tokens"]


def owned_tokens(array: TokenArray) -> TokenArray:
    """``array`` itself when nobody can change it (read-only, owning its memory), else a
    read-only private copy."""
    if not _frozen(array):
        array = array.copy()
        array.flags.writeable = False
    return array


class Prompt:
    """One prompt on one stage: its envelope, tokens and width, and the hashes computed so far.

    ``tokens`` never changes (see :func:`owned_tokens`). ``hashes`` maps prefix lengths to their
    ``"blake3:"`` prefix hashes, bound to the envelope's ``cache_salt`` when it has one.
    """

    __slots__ = (
        "_grid",
        "_grid_policy",
        "_ladder",
        "_ladder_policy",
        "base",
        "config",
        "group",
        "hashes",
        "n",
        "token_start",
        "tokens",
        "width",
    )

    def __init__(
        self,
        config: StageConfig,
        base: MessageBase,
        token_start: int,
        tokens: TokenArray,
        width: int,
        *,
        hashes: dict[int, str] | None = None,
    ) -> None:
        self.config = config
        self.base = base
        self.token_start = token_start
        self.tokens = tokens
        self.width = width
        self.n = int(tokens.size)
        self.group = (token_start, width, base.chat_template_id, base.cache_salt)
        """What besides the tokens tells two prompts' keys apart on one stage."""
        self.hashes: dict[int, str] = {} if hashes is None else hashes
        self._grid: GridFingerprints | None = None
        self._grid_policy: CandidatePolicy | None = None
        """The policy :attr:`_grid` was last handed out for: a stage asks with its own every
        time, so most calls are one identity test."""
        self._ladder: list[int] = []
        self._ladder_policy: CandidatePolicy | None = None

    def same_request(
        self, config: StageConfig, base: MessageBase, token_start: int, width: int
    ) -> bool:
        """Whether a call with these arguments (and this prompt's tokens) has the same keys."""
        return (
            self.token_start == token_start
            and self.width == width
            and (self.config is config or self.config == config)
            and (
                self.base is base
                or (
                    self.base.chat_template_id == base.chat_template_id
                    and self.base.cache_salt == base.cache_salt
                )
            )
        )

    def hash_counts(self, counts: Iterable[int]) -> dict[int, str]:
        """The prefix hashes of ``counts`` (every one of them in ``hashes`` afterwards); the
        missing ones cost one pass over the tokens up to the longest."""
        known = self.hashes
        missing = [c for c in counts if c not in known] if known else counts
        if missing:
            missing = sorted(set(missing))
            prelude = _stage_prelude(self.config, self.token_start, self.base.chat_template_id)
            data = self.tokens.data.cast("B")
            salt = self.base.cache_salt
            if salt is None:
                _hash_counts(prelude, data, missing, known)
            else:
                fresh = _hash_counts(prelude, data, missing)
                known.update({c: salted_prefix_hash(v, salt) for c, v in fresh.items()})
        return known

    def record_counts(self, policy: CandidatePolicy) -> list[int]:
        """``policy.record_candidate_token_counts(n)``, computed once per request for the
        stages that record alike (see :meth:`GridFingerprints.ladder`; a restore hashes them
        with its probes, the record stores them). Not to be changed."""
        if self._ladder_policy is not policy:
            self._ladder = self.grid(policy).ladder(policy)
            self._ladder_policy = policy
        return self._ladder

    def grid(self, policy: CandidatePolicy) -> GridFingerprints:
        """The lookup grid of this prompt under ``policy`` with its fingerprints."""
        grid = self._grid
        if grid is not None and self._grid_policy is policy:
            return grid
        if grid is None or (
            grid.policy is not policy
            and grid.grid_key != (policy.min_tokens, policy.effective_stride)
        ):
            grid = self._grid = grid_fingerprints(self.tokens, policy)
        self._grid_policy = policy
        return grid


class GridFingerprints:
    """The lookup candidates of one prompt (longest first) and a fingerprint of each prefix."""

    __slots__ = (
        "_ladders",
        "_stride",
        "by_print",
        "counts",
        "grid_key",
        "policy",
        "prints",
        "shared_prints",
        "tokens",
    )

    def __init__(self, tokens: TokenArray, policy: CandidatePolicy) -> None:
        self.tokens = tokens
        self.policy = policy
        """The policy the grid was made for (others with the same :attr:`grid_key` share it)."""
        stride = self._stride = policy.effective_stride
        self.grid_key = (policy.min_tokens, stride)
        """What the grid depends on besides the tokens."""
        counts = policy.candidate_token_counts(int(tokens.size))
        self.counts: list[int] = counts
        """``policy.candidate_token_counts(len(tokens))``: the grid, longest first."""
        self.prints: list[int] = _prefix_fingerprints(tokens, counts, stride)
        """The fingerprint of each prefix of ``counts``, in the same order."""
        self.by_print: dict[int, int] = dict(zip(self.prints, counts, strict=True))
        """Fingerprint -> candidate length (the shortest, where two share one)."""
        self._ladders: dict[tuple[int, int], list[int]] = {}
        self.shared_prints = len(self.by_print) < len(counts)
        """Whether two lengths of this prompt share a fingerprint (a 64-bit coincidence, or a
        constructed prompt): :meth:`among` then checks every length."""

    def ladder(self, policy: CandidatePolicy) -> list[int]:
        """``policy.record_candidate_token_counts(len(tokens))`` (``policy`` has this grid's
        :attr:`grid_key`), shared by the policies that record alike (every stage of a
        pipeline, usually). Not to be changed."""
        key = (policy.record_limit, policy.max_resident_tokens_hint)
        ladder = self._ladders.get(key)
        if ladder is None:
            ladder = self._ladders[key] = policy.record_candidate_token_counts(len(self.tokens))
        return ladder

    def position(self, count: int) -> int:
        """The index of candidate length ``count`` in :attr:`counts` (a candidate: unchecked).

        The grid is ``N``, then lines ``stride`` apart, then ``min_tokens``."""
        counts = self.counts
        if count == counts[0]:
            return 0
        if count == counts[-1]:
            return len(counts) - 1
        return 1 + (counts[1] - count) // self._stride

    def among(self, prints: Mapping[int, object]) -> list[int]:
        """The candidate lengths whose fingerprint is a key of ``prints``, longest first (the
        two key sets are intersected in C, walking the smaller one)."""
        if self.shared_prints:
            return [c for f, c in zip(self.prints, self.counts, strict=True) if f in prints]
        by_print = self.by_print
        found = by_print.keys() & prints.keys()
        if not found:
            return []
        return sorted([by_print[f] for f in found], reverse=True)


SAMPLE_TOKENS: Final = 2
"""How many tokens a fingerprint reads from each whole block of the grid's stride: the block's
last two (the last one of a one-token block). Not a setting: the two int32 tokens are read as
one unsigned 64-bit value."""

_MULTIPLIER: Final = 0x9E3779B97F4A7C15
_MASK64: Final = (1 << 64) - 1


def _prefix_fingerprints(tokens: TokenArray, counts: list[int], stride: int) -> list[int]:
    """For each ``c`` in ``counts`` (a grid: ``N``, lines ``stride`` apart, the last length),
    a fingerprint of ``tokens[:c]``, XORed with ``c``.

    Over the whole blocks of ``stride`` tokens, a polynomial rolling hash (mod 2**64) of one
    sample per block: its last :data:`SAMPLE_TOKENS` tokens as one unsigned 64-bit value (the
    last token as a Python int for a one-token block). For the rest (``c % stride`` tokens),
    Python's ``hash`` of that and the bytes of every remaining token (salted per process;
    fingerprints never leave it).

    Equal prefixes have equal fingerprints, which is all the filter needs. Two prefixes that
    differ only in unsampled tokens share one, and a restore then hashes and looks up that
    length for nothing: a digest of a pass the record makes anyway, and one lookup (the key
    decides). Two lengths of one prompt may share one too; :class:`GridFingerprints` then
    checks every length."""
    if not counts:
        return []
    blocks = counts[0] // stride
    if stride % SAMPLE_TOKENS == 0:
        # With an even stride, each block's last two tokens are one aligned 64-bit word of
        # the blocks' bytes: a strided view (two numpy calls, no copy).
        words = stride // SAMPLE_TOKENS
        samples = tokens[: blocks * stride].view(np.uint64)[words - 1 :: words]
    elif stride >= SAMPLE_TOKENS:
        ends = tokens[: blocks * stride].reshape(blocks, stride)[:, stride - SAMPLE_TOKENS :]
        samples = np.ascontiguousarray(ends).view(np.uint64).ravel()
    else:  # (a negative token wraps to the same value mod 2**64)
        samples = tokens[:blocks].astype(np.uint64)
    rolling: Sequence[int] | npt.NDArray[np.uint64]
    if blocks < _VECTOR_BLOCKS:
        rolling = [0]
        value = 0
        for sample in samples.tolist():
            value = (value * _MULTIPLIER + sample) & _MASK64
            rolling.append(value)
    else:
        rolling = _rolling_hashes(samples)

    def one(count: int) -> int:
        whole, part = divmod(count, stride)
        value = int(rolling[whole])
        if part:
            value = hash((value, tokens[whole * stride : count].tobytes()))
        return value ^ count

    if len(counts) < 3:
        return [one(c) for c in counts]
    # The lines between the first and the last length are consecutive multiples of the stride.
    high, low = counts[1] // stride, counts[-2] // stride
    if isinstance(rolling, list):
        lines = [rolling[whole] ^ (whole * stride) for whole in range(high, low - 1, -1)]
    else:
        wholes = np.arange(high, low - 1, -1, dtype=np.uint64)
        lines = (rolling[wholes] ^ (wholes * np.uint64(stride))).tolist()
    return [one(counts[0]), *lines, one(counts[-1])]


_VECTOR_BLOCKS: Final = 48
"""Blocks from which :func:`_prefix_fingerprints` computes the rolling hash with numpy (a
Python loop costs about 70 ns a block; numpy about 3 us a prompt whatever its length: at the
runtime's 64-token grid a 131,072-token prompt has 2,048 blocks, 134 us against 4.5)."""

_INVERSE: Final = pow(_MULTIPLIER, -1, 1 << 64)
"""The multiplier's inverse mod 2**64 (it is odd)."""
_powers: tuple[npt.NDArray[np.uint64], npt.NDArray[np.uint64]] = (
    np.ones(1, dtype=np.uint64),
    np.ones(1, dtype=np.uint64),
)
"""The multiplier's powers 0, 1, ... and its inverse's, mod 2**64 (grown as needed)."""


def _rolling_hashes(samples: npt.NDArray[np.uint64]) -> npt.NDArray[np.uint64]:
    """The rolling hash after each of ``samples`` (0 before the first), in numpy:
    ``h_i = h_(i-1) * m + s_i = m**i * sum(s_j * m**-j for j <= i)`` mod 2**64, one cumulative
    sum of the samples scaled by the inverse's powers (numpy's uint64 arithmetic wraps)."""
    global _powers
    count = int(samples.size)
    powers, inverses = _powers
    if powers.size <= count:
        size = max(count + 1, 2 * powers.size)
        steps = np.full(size, _MULTIPLIER, dtype=np.uint64)
        steps[0] = 1
        inverse_steps = np.full(size, _INVERSE, dtype=np.uint64)
        inverse_steps[0] = 1
        powers, inverses = _powers = (np.cumprod(steps), np.cumprod(inverse_steps))
    rolling = np.zeros(count + 1, dtype=np.uint64)
    np.cumsum(samples * inverses[1 : count + 1], out=rolling[1:])
    rolling[1:] *= powers[1 : count + 1]
    return rolling


_PRELUDES: Final = 64
_preludes: dict[tuple[int, int, str | None], tuple[StageConfig, bytes]] = {}


def _stage_prelude(config: StageConfig, token_start: int, namespace: str | None) -> bytes:
    """What the hash covers before the tokens (``identity._prelude``), remembered per stage
    object: the identity module's checks and its memo keyed by the whole configuration cost
    more than this lookup, made once per prompt on every stage."""
    key = (id(config), token_start, namespace)
    known = _preludes.get(key)
    if known is None or known[0] is not config:
        if len(_preludes) >= _PRELUDES:
            _preludes.clear()
        known = (config, _prelude(config, token_start, namespace, None))
        _preludes[key] = known
    return known[1]


_RECENT_GRIDS: Final = 16
_recent: OrderedDict[tuple[int, int, int], GridFingerprints] = OrderedDict()
"""The grids made lately, oldest first (its oldest item goes in one call, which two threads
replaying at once, as a thread pool's units do, cannot interleave)."""


_latest: GridFingerprints | None = None
"""The grid handed out last: the next stage of the pipeline asks for it."""


def grid_fingerprints(tokens: TokenArray, policy: CandidatePolicy) -> GridFingerprints:
    """The grid fingerprints of ``tokens`` (read-only: see :func:`owned_tokens`) under
    ``policy``, shared with whoever asked lately for the same array and the same grid (the
    other stages of the pipeline)."""
    global _latest
    grid_key = (policy.min_tokens, policy.effective_stride)
    grid = _latest
    if grid is not None and grid.tokens is tokens and grid.grid_key == grid_key:
        return grid
    key = (id(tokens), *grid_key)
    grid = _recent.get(key)
    if grid is None or grid.tokens is not tokens:
        grid = GridFingerprints(tokens, policy)
        _recent[key] = grid
        if len(_recent) > _RECENT_GRIDS:
            _recent.popitem(last=False)
    _latest = grid
    return grid
