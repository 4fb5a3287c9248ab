"""The paged index's resident entries, and the token bytes each keeps for the footprint."""

from __future__ import annotations

import weakref
from collections import OrderedDict
from collections.abc import Hashable

import numpy as np

from stage_runtime.cache.paged.chains import PageChain
from stage_runtime.cache.paged.results import EntryKind, Payload, _entry_name, _is_virtual
from stage_runtime.identity import TokenArray

_SHARED_PROMPTS = 16
"""Prompts :func:`_shared_segment` remembers the segments of: the stages of a pipeline record the
same prompt (the same read-only array, handed to every stage) one after the other, so a short
memory lets them all keep one copy of each segment."""
_recent_prompts: OrderedDict[int, tuple[weakref.ref[TokenArray], dict[tuple[int, int], bytes]]] = (
    OrderedDict()
)
"""``id(tokens)`` -> the array (weakly: an id is reused once its array is gone) and the bytes of
its segments made so far, by ``(start, stop)``. Keyed by the array, not by the bytes: hashing
every 2 KiB segment to find an equal one cost a stored page more than the rest of its
footprint; and an ordered dict, whose oldest item goes in O(1)."""


def _segments_of(tokens: TokenArray) -> dict[tuple[int, int], bytes]:
    """The bytes of ``tokens``' segments made lately, by ``(start, stop)`` (see
    :func:`_shared_segment`)."""
    slot = _recent_prompts.get(id(tokens))
    if slot is None or slot[0]() is not tokens:
        slot = (weakref.ref(tokens), {})
        _recent_prompts[id(tokens)] = slot
        if len(_recent_prompts) > _SHARED_PROMPTS:
            _recent_prompts.popitem(last=False)
    return slot[1]


def _shared_segment(
    tokens: TokenArray, start: int, stop: int, made: dict[tuple[int, int], bytes] | None = None
) -> bytes:
    """``tokens[start:stop]`` as bytes: the same bytes object another stage made lately from the
    same tokens array (one copy for all the stages), else a new one. ``made``: the array's
    :func:`_segments_of`, when the caller cuts several segments of it."""
    segments = _segments_of(tokens) if made is None else made
    data = segments.get((start, stop))
    if data is None:
        data = segments[start, stop] = tokens[start:stop].tobytes()
    return data


Footprint = bytes | list[tuple[bytes, bytes]]
"""What the footprint needs of an entry: a page's or a tail's token bytes (its one segment
follows ``entry.group``), or an exact entry's ``(parent key, token bytes)`` segments."""


def _footprint_segments(chain: PageChain, entry: _Entry) -> Footprint:
    """``entry``'s token rows for the footprint (see :data:`Footprint`). The bytes, not views of
    the prompt: a view would keep the whole prompt alive as long as the entry. (Kept compact:
    one is held per resident entry until the footprint is read.)"""
    tokens = chain.tokens
    if entry.kind == "exact":
        # As chain.segments(n): each page of the first n tokens, then the rest.
        p, n = chain.page_tokens, entry.token_count
        return [
            (chain.parent_key(i), _shared_segment(tokens, i * p, min((i + 1) * p, n)))
            for i in range(-(-n // p))
        ]
    start = entry.token_start
    return _shared_segment(tokens, start, start + entry.token_count)


def _stored(segment: Payload) -> Payload:
    """Own a segment's bytes (so a page never pins the frame it was cut from)."""
    if _is_virtual(segment):
        return segment
    owned = np.array(segment, dtype=np.uint8, copy=True)
    owned.flags.writeable = False
    return owned


class _Entry:
    """One resident entry (a plain slotted class: the index sets its fields on every use)."""

    __slots__ = (
        "bytes_per_token",
        "children",
        "footprint",
        "group",
        "hits",
        "key",
        "kind",
        "label",
        "last_used",
        "meta",
        "nbytes",
        "parent",
        "payload",
        "priority",
        "tier",
        "token_count",
        "token_start",
    )

    def __init__(
        self,
        key: bytes,
        label: str,
        kind: EntryKind,
        parent: _Entry | None,
        group: bytes,
        token_start: int,
        token_count: int,
        payload: Payload,
        nbytes: int,
        bytes_per_token: int,
        meta: Hashable,
        last_used: int,
    ) -> None:
        self.key = key
        self.label = label
        """The recording chain's label (the first part of :attr:`name`)."""
        self.kind = kind
        self.parent = parent
        self.group = group
        """Key of the parent entry or of the namespace root."""
        self.token_start = token_start
        self.token_count = token_count
        self.payload = payload
        self.nbytes = nbytes
        """``payload.size``."""
        self.bytes_per_token = bytes_per_token
        self.meta = meta
        self.last_used = last_used
        self.children = 0
        """Cached entries whose parent this is (kept under ``reuse`` only, for its leaf heap)."""
        self.hits = 0
        """Restores that used this entry."""
        self.priority = 0.0
        """Eviction priority under the ``reuse`` policy (lowest goes first); 0 under ``lru``."""
        self.tier = -1
        """The ``adaptive`` policy's class of a resident entry (that of the last record that used
        it, :func:`~stage_runtime.cache.paged.eviction.record_class`; while a record runs, its
        class so far); -1 when not resident."""
        self.footprint: Footprint | None = None
        """Its token segments while not yet added to the index's footprint."""

    @property
    def name(self) -> str:
        """Printable name (made on demand: most entries are never named)."""
        return _entry_name(self.label, self.kind, self.token_start, self.token_count, self.key)


def _leaf_item(entry: _Entry) -> tuple[float, int, int, _Entry]:
    """Heap item of a leaf: lowest priority first, then least recently used."""
    return (entry.priority, entry.last_used, id(entry), entry)
