"""Deterministic token blocks from hash ids, generated with numpy.

Each block id becomes ``block_size`` token ids that depend only on the id (and the block size).
Equal ids give equal blocks, so equal id chains give equal token prefixes; distinct ids give
distinct blocks (guaranteed for full blocks of at least 4 tokens, see :class:`BlockTokenizer`).

Nothing is cached: a prompt's blocks are computed in one vectorised pass, which costs less than
the BLAKE3 hashing every stage does over the same tokens anyway, and keeps memory flat.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Sequence

import attrs
import numpy as np
import numpy.typing as npt

from stage_runtime.errors import ConfigError
from stage_runtime.sim.trace import SimRequest, check_block_size

__all__ = ["VOCAB_SIZE", "BlockTokenizer"]

VOCAB_SIZE = 1 << 17
"""Token ids are drawn from ``[0, VOCAB_SIZE)``, about the size of current LLM vocabularies."""

_LANES = 4
_MAX_RUN = 32
_LANE_BITS = 17
_LANE_SHIFTS = np.array([0, 16, 32, 48], dtype=np.uint64)
_LANE_MASK = np.uint64((1 << _LANE_BITS) - 1)
_BASE_SEED = 0x5EED_B10C
_CHUNK_REQUESTS = 256
"""Requests whose block ids :meth:`BlockTokenizer.each_request_tokens` mixes in one pass."""


_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_MIX1 = np.uint64(0xBF58476D1CE4E5B9)
_MIX2 = np.uint64(0x94D049BB133111EB)
_SHIFT1, _SHIFT2, _SHIFT3 = np.uint64(30), np.uint64(27), np.uint64(31)


def _mix64(values: npt.NDArray[np.uint64]) -> npt.NDArray[np.uint64]:
    """The splitmix64 finaliser: a bijection on 64-bit integers that scatters every input bit.
    (A prompt's few dozen ids cost numpy's per-call overhead, not arithmetic: new arrays, as
    in-place operators cost a tenth more per call here, twice as much on a single id.)"""
    z = values + _GOLDEN
    z = z ^ (z >> _SHIFT1)
    z = z * _MIX1
    z = z ^ (z >> _SHIFT2)
    z = z * _MIX2
    return z ^ (z >> _SHIFT3)


@attrs.define(eq=False)
class BlockTokenizer:
    """Turns block ids into token ids.

    Token ``p`` of the block of id ``h`` is ``base[p] ^ lane(h, (p // run) mod 4)``: ``base`` is
    one fixed pseudo-random block, ``lane(h, j)`` is 17 bits of ``splitmix64(h)`` starting at
    bit ``16 j`` and ``run`` is ``min(32, block_size // 4)`` (at least 1). The four lanes cover
    all 64 bits of the mixed id and splitmix64 is a bijection, so two distinct ids differ in at
    least one lane, hence in every token of that lane; every full block of 4 tokens or more holds
    all four lanes, so distinct ids give distinct blocks (and so do partial blocks of more than
    ``3 * run`` tokens). Runs of 32 tokens keep numpy's inner loops long: a prompt costs one
    broadcast XOR per token, with no Python loop over tokens or blocks.
    """

    block_size: int = attrs.field(default=512)
    """Tokens per block (512 in the Mooncake traces): an integer in ``[4, 1,048,576]``
    (:func:`~stage_runtime.sim.trace.check_block_size`), else a ConfigError."""

    _base: npt.NDArray[np.uint32] = attrs.field(init=False, repr=False)
    _lane_of: npt.NDArray[np.intp] = attrs.field(init=False, repr=False)
    _run: int = attrs.field(init=False, repr=False)

    def __attrs_post_init__(self) -> None:
        check_block_size(self.block_size)
        rng = np.random.default_rng(_BASE_SEED)
        self._base = rng.integers(0, VOCAB_SIZE, size=self.block_size, dtype=np.uint32)
        self._run = max(1, min(_MAX_RUN, self.block_size // _LANES))
        positions = np.arange(self.block_size, dtype=np.intp)
        self._lane_of = (positions // self._run) % _LANES

    def _lanes(self, block_ids: Sequence[int] | npt.NDArray[np.int64]) -> npt.NDArray[np.uint32]:
        try:
            ids = np.asarray(block_ids, dtype=np.int64).reshape(-1).view(np.uint64)
        except OverflowError:  # ids beyond int64 (unsigned 64-bit hashes): taken modulo 2**64
            ids = np.asarray([int(i) % 2**64 for i in block_ids], dtype=np.uint64)
        return _mixed_lanes(ids)

    def _chunk_lanes(self, requests: Sequence[SimRequest]) -> npt.NDArray[np.uint32] | None:
        """The lanes of every block id of ``requests``, in order, mixed in one pass; None when
        an id list is not a tuple numpy takes as int64 as it is (each request then on its own,
        as :meth:`_lanes` converts it)."""
        if any(type(request.block_ids) is not tuple for request in requests):
            return None
        count = sum(len(request.block_ids) for request in requests)
        chained = itertools.chain.from_iterable(request.block_ids for request in requests)
        try:
            ids = np.fromiter(chained, dtype=np.int64, count=count).view(np.uint64)
        except (OverflowError, TypeError, ValueError):
            return None
        return _mixed_lanes(ids)

    def blocks(self, block_ids: Sequence[int] | npt.NDArray[np.int64]) -> npt.NDArray[np.int32]:
        """Return the full blocks of ``block_ids`` as a ``(len(block_ids), block_size)`` array."""
        return self._blocks(self._lanes(block_ids))

    def _blocks(self, lanes: npt.NDArray[np.uint32]) -> npt.NDArray[np.int32]:
        """:meth:`blocks` of the ids whose lanes these are."""
        count = lanes.shape[0]
        period = self._run * _LANES
        if self.block_size % period == 0:
            # One period of each block's mask (each lane repeated ``run`` times), XORed with
            # every period of the base block: numpy's inner loops run a whole period long.
            base = self._base.reshape(self.block_size // period, period)
            mask = lanes.repeat(self._run, axis=1)
            full = (base[None] ^ mask[:, None, :]).reshape(count, self.block_size)
        else:
            full = np.take(lanes, self._lane_of, axis=1)
            full ^= self._base
        return full.view(np.int32)

    def block(self, block_id: int) -> npt.NDArray[np.int32]:
        """Return the ``block_size`` tokens of one block id."""
        row: npt.NDArray[np.int32] = self.blocks([block_id])[0]
        return row

    def prompt(
        self,
        block_ids: Sequence[int],
        input_length: int,
        block_lengths: Sequence[int] | None = None,
    ) -> npt.NDArray[np.int32]:
        """Return the prompt made of ``block_ids``, as a contiguous int32 array.

        Args:
            block_ids: One id per block.
            input_length: Prompt length in tokens.
            block_lengths: Tokens taken from each block; ``None`` takes whole blocks and cuts the
                last so the prompt has ``input_length`` tokens.

        Returns:
            ``input_length`` token ids.

        Raises:
            ConfigError: The blocks hold fewer than ``input_length`` tokens, or the lengths do
                not match the ids.
        """
        if block_lengths is None:
            used = self._blocks_used(block_ids, input_length)
            return self._whole_blocks(self._lanes(block_ids[:used]), input_length)
        lengths = self._lengths(block_ids, input_length, block_lengths)
        return self._cut_blocks(self._lanes(block_ids), lengths)

    def _blocks_used(self, block_ids: Sequence[int], input_length: int) -> int:
        """How many of ``block_ids`` a prompt of ``input_length`` tokens takes whole blocks of.

        Raises:
            ConfigError: they hold fewer tokens.
        """
        used = -(-input_length // self.block_size)
        if used > len(block_ids):
            msg = (
                f"input_length must be <= block_size * len(block_ids) = "
                f"{self.block_size * len(block_ids)}, got {input_length}"
            )
            raise ConfigError(msg)
        return used

    def _whole_blocks(
        self, lanes: npt.NDArray[np.uint32], input_length: int
    ) -> npt.NDArray[np.int32]:
        """The first ``input_length`` tokens of the blocks whose lanes these are: an array of
        their own (not a view of a larger one) when the block size is a whole number of lane
        periods, so the driver can freeze it for the pipeline, which then keeps it without a
        copy (of a prompt of the synthetic trace: about 2 us a request)."""
        period = self._run * _LANES
        size = self.block_size
        if size % period != 0:
            flat: npt.NDArray[np.int32] = self._blocks(lanes).reshape(-1)
            return flat[:input_length]
        # _blocks' broadcast XOR, written straight into the prompt's own array.
        whole, rest = divmod(input_length, size)
        tokens = np.empty(input_length, dtype=np.int32)
        out = tokens.view(np.uint32)
        base = self._base.reshape(size // period, period)
        mask = lanes.repeat(self._run, axis=1)
        if whole:
            into = out[: whole * size].reshape(whole, size // period, period)
            np.bitwise_xor(base[None], mask[:whole, None, :], out=into)
        if rest:
            out[whole * size :] = (base ^ mask[whole]).reshape(-1)[:rest]
        return tokens

    def _lengths(
        self, block_ids: Sequence[int], input_length: int, block_lengths: Sequence[int]
    ) -> npt.NDArray[np.int64]:
        """``block_lengths``, checked against the ids and the prompt's length.

        Raises:
            ConfigError: they do not match.
        """
        if len(block_lengths) != len(block_ids):
            msg = (
                f"block_lengths must have one entry per block id ({len(block_ids)}), "
                f"got {len(block_lengths)}"
            )
            raise ConfigError(msg)
        lengths = np.asarray(block_lengths, dtype=np.int64)
        if lengths.size and (lengths.min() < 0 or lengths.max() > self.block_size):
            msg = f"block_lengths must lie in [0, {self.block_size}], got {list(block_lengths)}"
            raise ConfigError(msg)
        if int(lengths.sum()) != input_length:
            msg = f"block_lengths must sum to input_length {input_length}, got {int(lengths.sum())}"
            raise ConfigError(msg)
        return lengths

    def _cut_blocks(
        self, lanes: npt.NDArray[np.uint32], lengths: npt.NDArray[np.int64]
    ) -> npt.NDArray[np.int32]:
        """The first ``lengths[i]`` tokens of each block whose lanes these are, joined."""
        full = self._blocks(lanes)
        keep = np.arange(self.block_size)[None, :] < lengths[:, None]
        return np.ascontiguousarray(full[keep])

    def request_tokens(self, request: SimRequest) -> npt.NDArray[np.int32]:
        """Return the prompt of a request."""
        return self.prompt(request.block_ids, request.input_length, request.block_lengths)

    def each_request_tokens(
        self, requests: Sequence[SimRequest]
    ) -> Iterator[npt.NDArray[np.int32]]:
        """The prompt of each request (:meth:`request_tokens`), in order, one at a time.

        The block ids of up to :data:`_CHUNK_REQUESTS` requests are mixed in one pass: a
        prompt's few dozen ids cost numpy's per-call overhead, which mixing them prompt by
        prompt paid every time (about half of a prompt's cost on the synthetic trace). Memory
        stays flat: a chunk's mixed ids, 16 bytes each, are all it keeps.

        Raises:
            ConfigError: as :meth:`request_tokens`, once that request's prompt is reached.
        """
        for start in range(0, len(requests), _CHUNK_REQUESTS):
            chunk = requests[start : start + _CHUNK_REQUESTS]
            lanes = self._chunk_lanes(chunk)
            if lanes is None:
                yield from map(self.request_tokens, chunk)
                continue
            end = 0
            for request in chunk:
                block_ids, input_length = request.block_ids, request.input_length
                first, end = end, end + len(block_ids)
                if request.block_lengths is None:
                    used = self._blocks_used(block_ids, input_length)
                    yield self._whole_blocks(lanes[first : first + used], input_length)
                else:
                    lengths = self._lengths(block_ids, input_length, request.block_lengths)
                    yield self._cut_blocks(lanes[first:end], lengths)


def _mixed_lanes(ids: npt.NDArray[np.uint64]) -> npt.NDArray[np.uint32]:
    """Each id's four 17-bit lanes of its splitmix64, one row per id."""
    mixed = _mix64(ids)
    lanes: npt.NDArray[np.uint32] = ((mixed[:, None] >> _LANE_SHIFTS) & _LANE_MASK).astype(
        np.uint32
    )
    return lanes
