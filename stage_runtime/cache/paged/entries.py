"""The paged index's resident entries, and the token bytes each keeps for the footprint."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable

import numpy as np

from stage_runtime.cache.paged.chains import PageChain
from stage_runtime.cache.paged.results import EntryKind, Payload, _entry_name, _is_virtual

_SHARED_SEGMENTS = 4096
"""Token segments :func:`_shared_segment` remembers: the stages of a pipeline record the same
prompts one after the other, so a short memory lets them all keep one copy of each segment."""
_recent_segments: OrderedDict[bytes, bytes] = OrderedDict()
"""An ordered dict, not a dict: ``next(iter(d))`` on a plain dict whose oldest keys were deleted
walks over their empty slots first, which made forgetting the oldest segment cost more than
everything else a stored page does."""


def _shared_segment(data: bytes) -> bytes:
    """``data``, or an equal bytes object recorded lately (one copy for all the stages)."""
    known = _recent_segments.get(data)
    if known is not None:
        return known
    _recent_segments[data] = data
    if len(_recent_segments) > _SHARED_SEGMENTS:
        _recent_segments.popitem(last=False)
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
        return [
            (parent, _shared_segment(part.tobytes()))
            for parent, part in chain.segments(entry.token_count)
        ]
    start = entry.token_start
    return _shared_segment(tokens[start : start + entry.token_count].tobytes())


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
        """The ``adaptive`` policy's class of a resident entry (0 once, 1 again); -1 else."""

    @property
    def name(self) -> str:
        """Printable name (made on demand: most entries are never named)."""
        return _entry_name(self.label, self.kind, self.token_start, self.token_count, self.key)


def _leaf_item(entry: _Entry) -> tuple[float, int, int, _Entry]:
    """Heap item of a leaf: lowest priority first, then least recently used."""
    return (entry.priority, entry.last_used, id(entry), entry)
