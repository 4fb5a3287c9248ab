"""Synthetic workloads: prompts sharing system prompts, and multi-turn conversations.

A synthetic prompt is a chain of blocks like a trace's, built from segments (a system prompt, a
question, a conversation turn). A segment of ``n`` tokens is ``ceil(n / block_size)`` blocks with
fresh ids, the last one partial, so a partial block can sit in the middle of a prompt and equal
segments are equal tokens to the last one.
"""

from __future__ import annotations

import itertools
import math
import numbers
from collections.abc import Iterator

import attrs
import numpy as np

from stage_runtime._validators import is_int
from stage_runtime.errors import ConfigError, shown
from stage_runtime.limits import MAX_BLOCKS, MAX_PROMPT_TOKENS, MAX_REQUESTS
from stage_runtime.sim.trace import SimRequest, check_block_size

__all__ = ["MAX_BLOCKS", "MAX_PROMPT_TOKENS", "MAX_REQUESTS", "WorkloadSpec", "synthetic_workload"]


def _at_least(minimum: int) -> attrs._ValidatorType[int]:
    def check(instance: object, attribute: attrs.Attribute[int], value: int) -> None:
        if not is_int(value):  # bool too: True is not a count
            msg = f"{attribute.name} must be an integer, got {shown(value)}"
            raise ConfigError(msg)
        if value < minimum:
            msg = f"{attribute.name} must be >= {minimum}, got {value}"
            raise ConfigError(msg)

    return check


@attrs.frozen(kw_only=True)
class WorkloadSpec:
    """The shape of a synthetic workload (``stage-runtime simulate``)."""

    groups: int = attrs.field(default=8, validator=_at_least(0))
    """Groups of prompts; the prompts of a group share one system prompt."""

    prompts_per_group: int = attrs.field(default=12, validator=_at_least(1))
    """Prompts in each group."""

    system_prompt_tokens: int = attrs.field(default=3072, validator=_at_least(0))
    """Length of each group's system prompt."""

    question_tokens: int = attrs.field(default=384, validator=_at_least(1))
    """Length of the question that follows the system prompt (different in every prompt)."""

    conversations: int = attrs.field(default=8, validator=_at_least(0))
    """Multi-turn conversations; turn ``t`` resends turns ``0..t-1`` and adds one."""

    turns: int = attrs.field(default=6, validator=_at_least(1))
    """Turns per conversation (each turn is one request)."""

    tokens_per_turn: int = attrs.field(default=512, validator=_at_least(1))
    """Tokens each turn adds to the conversation."""

    requests_per_s: float = attrs.field(default=4.0)
    """Mean arrival rate (Poisson arrivals)."""

    seed: int = attrs.field(default=0, validator=_at_least(0))
    """Seed of the arrival order and times (numpy seeds are non-negative)."""

    def __attrs_post_init__(self) -> None:
        rate = self.requests_per_s
        if isinstance(rate, bool) or not isinstance(rate, numbers.Real):
            msg = f"requests_per_s must be a number, got {shown(rate)}"
            raise ConfigError(msg)
        if not self.requests_per_s > 0:
            msg = f"requests_per_s must be > 0, got {self.requests_per_s}"
            raise ConfigError(msg)
        if self.groups == 0 and self.conversations == 0:
            msg = "groups and conversations are both 0: the workload has no requests"
            raise ConfigError(msg)
        # Checked from the shape, before anything is built: 10^8 groups grew to gigabytes
        # before they ended in a MemoryError.
        if self.request_count > MAX_REQUESTS:
            msg = (
                f"the workload would have {self.request_count:,} requests; at most "
                f"{MAX_REQUESTS:,} are generated (fewer --groups, --prompts-per-group, "
                "--conversations or --turns)"
            )
            raise ConfigError(msg)
        if self.prompt_tokens > MAX_PROMPT_TOKENS:
            msg = (
                f"the workload would have {self.prompt_tokens:,} prompt tokens; at most "
                f"{MAX_PROMPT_TOKENS:,} are generated (shorter prompts, fewer requests)"
            )
            raise ConfigError(msg)

    @property
    def request_count(self) -> int:
        """Number of requests the workload has."""
        return self.groups * self.prompts_per_group + self.conversations * self.turns

    @property
    def prompt_tokens(self) -> int:
        """Prompt tokens summed over the workload's requests (turn ``t`` resends ``t - 1``)."""
        group_tokens = self.prompts_per_group * (self.system_prompt_tokens + self.question_tokens)
        turn_tokens = self.tokens_per_turn * self.turns * (self.turns + 1) // 2
        return self.groups * group_tokens + self.conversations * turn_tokens

    def block_count(self, block_size: int) -> int:
        """Blocks summed over the workload's prompts, with ``block_size`` tokens per block."""
        system = -(-self.system_prompt_tokens // block_size)
        question = -(-self.question_tokens // block_size)
        turn = -(-self.tokens_per_turn // block_size)
        return self.groups * self.prompts_per_group * (system + question) + (
            self.conversations * turn * self.turns * (self.turns + 1) // 2
        )


@attrs.define(eq=False)
class _Segments:
    block_size: int
    _ids: Iterator[int] = attrs.field(factory=itertools.count)

    def new(self, tokens: int) -> tuple[list[int], list[int]]:
        full, rest = divmod(tokens, self.block_size)
        lengths = [self.block_size] * full + ([rest] if rest else [])
        return [next(self._ids) for _ in lengths], lengths


def synthetic_workload(spec: WorkloadSpec, *, block_size: int = 512) -> list[SimRequest]:
    """Build the requests of a synthetic workload, in arrival order.

    Every source (a group's prompts, a conversation's turns) keeps its own order; sources are
    interleaved at random, and arrival gaps are exponential with mean ``1 / requests_per_s``.
    Both come from ``spec.seed``, so equal specs give equal workloads.

    Args:
        spec: The workload's shape.
        block_size: Tokens per block.

    Returns:
        The requests, indexed and timed in arrival order.

    Raises:
        ConfigError: ``block_size`` is not an integer in ``[4, 1,048,576]``, or would give the
            workload more than :data:`MAX_BLOCKS` blocks.
    """
    check_block_size(block_size)
    blocks = spec.block_count(block_size)
    if blocks > MAX_BLOCKS:
        msg = (
            f"block_size {block_size} would give the workload {blocks:,} blocks; at most "
            f"{MAX_BLOCKS:,} are generated (larger blocks, or a smaller workload)"
        )
        raise ConfigError(msg)
    segments = _Segments(block_size)
    sources: list[list[tuple[list[int], list[int]]]] = []
    for _ in range(spec.groups):
        system = segments.new(spec.system_prompt_tokens)
        prompts = []
        for _ in range(spec.prompts_per_group):
            question = segments.new(spec.question_tokens)
            prompts.append((system[0] + question[0], system[1] + question[1]))
        # Every prompt of a group is its own source: they may arrive in any order.
        sources.extend([prompt] for prompt in prompts)
    for _ in range(spec.conversations):
        ids: list[int] = []
        lengths: list[int] = []
        turns = []
        for _ in range(spec.turns):
            turn_ids, turn_lengths = segments.new(spec.tokens_per_turn)
            ids = ids + turn_ids
            lengths = lengths + turn_lengths
            turns.append((ids, lengths))
        sources.append(turns)

    rng = np.random.default_rng(spec.seed)
    # A uniform shuffle of the sources' labels (one label per request) interleaves them at random
    # while each source keeps its own order: its k-th label takes its k-th request.
    labels = rng.permutation(np.repeat(np.arange(len(sources)), [len(s) for s in sources]))
    cursor = [0] * len(sources)
    total = int(labels.size)
    gaps = rng.exponential(1.0 / spec.requests_per_s, size=total)
    requests: list[SimRequest] = []
    arrival = 0.0
    for index, label in enumerate(labels.tolist()):
        block_ids, block_lengths = sources[label][cursor[label]]
        cursor[label] += 1
        if index:
            arrival += float(gaps[index])
            if not math.isfinite(arrival):
                msg = (
                    f"an arrival rate of {spec.requests_per_s!r} requests per second is too "
                    "small: the workload's arrival times overflow"
                )
                raise ConfigError(msg)
        requests.append(
            SimRequest(
                index=index,
                arrival_s=arrival,
                input_length=sum(block_lengths),
                block_ids=tuple(block_ids),
                block_lengths=tuple(block_lengths),
            )
        )
    return requests
