"""The paged index's resident entries, and the token bytes each keeps for the footprint."""

from __future__ import annotations

import collections
import operator
import weakref
from collections import OrderedDict
from collections.abc import Hashable, Iterable

import numpy as np

from stage_runtime.cache.paged.chains import PageChain
from stage_runtime.cache.paged.results import EntryKind, Payload, _entry_name, _is_virtual
from stage_runtime.identity import TokenArray

_SHARED_PROMPTS = 16
"""Prompts :func:`_shared_segment` remembers the segments of: the stages of a pipeline record the
same prompt (the same read-only array, handed to every stage) one after the other, so a short
memory lets them all keep one copy of each segment."""


class _Segments:
    """The token bytes cut lately from one prompt array (see :func:`_segments_of`)."""

    __slots__ = ("cut", "pages", "pages_from", "tokens")

    def __init__(self, tokens: TokenArray) -> None:
        self.tokens = weakref.ref(tokens)
        """The array, weakly: its id is reused once it is gone."""
        self.cut: dict[tuple[int, int], bytes] = {}
        """Segments cut one by one, by ``(start, stop)`` (tails and exact entries)."""
        self.pages: dict[int, list[bytes]] = {}
        """The bytes of every full page, by page size, from :attr:`pages_from` on (``b""``
        before): cut together, one bytes slice each (cheaper than a numpy slice per page), the
        first time a page is stored and as earlier ones are asked for. Only the pages some
        stage stores are cut: the leading pages most prompts share are cached already."""
        self.pages_from: dict[int, int] = {}
        """The first page cut, by page size."""

    def page_rows(self, tokens: TokenArray, page_tokens: int, first: int = 0) -> list[bytes]:
        """The bytes of each full page of ``tokens`` (the array this memo is of): of every page
        from ``first`` on (those before may be ``b""``)."""
        rows = self.pages.get(page_tokens)
        if rows is None:
            cut = int(tokens.size) // page_tokens
            rows = self.pages[page_tokens] = [b""] * cut
        else:
            cut = self.pages_from[page_tokens]
        if first < cut:
            width = 4 * page_tokens
            raw = tokens.data.cast("B")[first * width : cut * width].tobytes()
            rows[first:cut] = [raw[i : i + width] for i in range(0, len(raw), width)]
            self.pages_from[page_tokens] = first
        return rows


_recent_prompts: OrderedDict[int, _Segments] = OrderedDict()
"""``id(tokens)`` -> the segments of the array made so far. Keyed by the array, not by the
bytes: hashing every 2 KiB segment to find an equal one cost a stored page more than the rest
of its footprint; and an ordered dict, whose oldest item goes in O(1)."""


def _segments_of(tokens: TokenArray) -> _Segments:
    """The segments of ``tokens`` made lately (see :func:`_shared_segment`)."""
    slot = _recent_prompts.get(id(tokens))
    if slot is None or slot.tokens() is not tokens:
        slot = _Segments(tokens)
        _recent_prompts[id(tokens)] = slot
        if len(_recent_prompts) > _SHARED_PROMPTS:
            _recent_prompts.popitem(last=False)
    return slot


def _shared_segment(tokens: TokenArray, start: int, stop: int) -> bytes:
    """``tokens[start:stop]`` as bytes: the same bytes object another stage made lately from the
    same tokens array (one copy for all the stages), else a new one."""
    segments = _segments_of(tokens).cut
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
    p = chain.page_tokens
    kind = entry.kind
    if kind == "exact":
        # As chain.segments(n): each page of the first n tokens (the bytes the pages of the
        # same prompt hold), then the rest.
        n = entry.token_count
        pages = _segments_of(tokens).page_rows(tokens, p)
        whole = n // p
        out = [(chain.parent_key(i), pages[i]) for i in range(whole)]
        if n % p:
            out.append((chain.parent_key(whole), _shared_segment(tokens, whole * p, n)))
        return out
    start = entry.token_start
    if kind == "page":
        return _segments_of(tokens).page_rows(tokens, p, start // p)[start // p]
    return _shared_segment(tokens, start, start + entry.token_count)


def _stored(segment: Payload) -> Payload:
    """Own a segment's bytes (so a page never pins the frame it was cut from)."""
    if _is_virtual(segment):
        return segment
    owned = np.array(segment, dtype=np.uint8, copy=True)
    owned.flags.writeable = False
    return owned


class _Shape:
    """What every entry of one kind stored by one record shares: its rows, size, description
    and name parts. Made by :class:`_Shapes`, which hands out one object for equal shapes, so that
    comparing two entries' rows is mostly an identity test, and an entry holds one reference
    for all of them (the garbage collector's full passes visit each reference of every resident
    entry)."""

    __slots__ = ("bytes_per_token", "kind", "label", "meta", "nbytes", "root", "token_count")

    def __init__(
        self,
        label: str,
        kind: EntryKind,
        root: bytes,
        token_count: int,
        nbytes: int,
        bytes_per_token: int,
        meta: Hashable,
    ) -> None:
        self.label = label
        """The recording chain's label (the first part of an entry's name)."""
        self.kind: EntryKind = kind
        self.root = root
        """The root key of the recording chain's namespace (the group of its first entry)."""
        self.token_count = token_count
        self.nbytes = nbytes
        """The payload's size."""
        self.bytes_per_token = bytes_per_token
        """Bytes of one token row (0: an exact entry that is not rows)."""
        self.meta = meta


ShapeFields = tuple[str, EntryKind, bytes, int, int, int, Hashable]
"""A :class:`_Shape`'s fields, in its constructor's order: label, kind, root, token count,
payload bytes, bytes per token, meta."""

_SHAPES = 4096
"""Distinct shapes a :class:`_Shapes` remembers of each kind (an index's pages have a handful);
past that it starts again, and entries of equal shapes are then told alike field by field."""


class _Shapes:
    """One index's :class:`_Shape` objects: one per distinct shape while remembered.

    Per index, so that an entry only ever holds a ``meta`` its own index recorded; keyed by the
    ``meta``'s type too, since equal values of two types (``1`` and ``True``) are not the same
    description. Pages apart from tails and exact entries: those come in as many shapes as
    there are prompt lengths, and must not push the pages' few out."""

    __slots__ = ("_others", "_pages")

    def __init__(self) -> None:
        self._pages: dict[tuple[object, ...], _Shape] = {}
        self._others: dict[tuple[object, ...], _Shape] = {}

    def get(self, fields: ShapeFields) -> _Shape:
        """The shape of ``fields`` (the same object as the last call's for equal ones)."""
        memo = self._pages if fields[1] == "page" else self._others
        key = (*fields, type(fields[6]))
        shape = memo.get(key)
        if shape is None:
            if len(memo) >= _SHAPES:
                memo.clear()
            shape = memo[key] = _Shape(*fields)
        return shape

    def forget(self) -> None:
        """Start again (entries keep their shapes; equal new ones are told alike field by
        field)."""
        self._pages.clear()
        self._others.clear()


class _Entry:
    """One resident entry (a plain slotted class: the index sets its fields on every use; what
    the entries of a record share is one :class:`_Shape`)."""

    __slots__ = (
        "children",
        "hits",
        "key",
        "last_used",
        "parent",
        "payload",
        "priority",
        "shape",
        "tier",
        "token_start",
    )

    def __init__(
        self,
        key: bytes,
        parent: _Entry | None,
        token_start: int,
        payload: Payload,
        shape: _Shape,
        last_used: int,
    ) -> None:
        self.key = key
        self.parent = parent
        self.token_start = token_start
        self.payload = payload
        self.shape = shape
        """Its rows, size, description and name parts (:attr:`nbytes` is ``payload.size``)."""
        self.last_used = last_used
        self.children = 0
        """Cached entries whose parent this is (kept under ``reuse`` only, for its leaf heap)."""
        self.hits = 0
        """Restores that used this entry (counted by the policies that read it: not ``lru``)."""
        self.priority = 0.0
        """Eviction priority under the ``reuse`` policy (lowest goes first); 0 under ``lru``."""
        self.tier = -1
        """The ``adaptive`` policy's class of a resident entry (that of the last record that used
        it, :func:`~stage_runtime.cache.paged.eviction.record_class`; while a record runs, its
        class so far); -1 when not resident."""

    @property
    def label(self) -> str:
        return self.shape.label

    @property
    def kind(self) -> EntryKind:
        return self.shape.kind

    @property
    def token_count(self) -> int:
        return self.shape.token_count

    @property
    def nbytes(self) -> int:
        return self.shape.nbytes

    @property
    def bytes_per_token(self) -> int:
        return self.shape.bytes_per_token

    @property
    def meta(self) -> Hashable:
        return self.shape.meta

    @property
    def group(self) -> bytes:
        """Key of the parent entry or of the namespace root."""
        parent = self.parent
        return self.shape.root if parent is None else parent.key

    @property
    def name(self) -> str:
        """Printable name (made on demand: most entries are never named)."""
        shape = self.shape
        return _entry_name(shape.label, shape.kind, self.token_start, shape.token_count, self.key)


_key_of = operator.attrgetter("key")


def _consume(calls: Iterable[object]) -> None:
    """Run an iterator of calls through, at C speed (their results are dropped)."""
    collections.deque(calls, maxlen=0)


def _leaf_item(entry: _Entry) -> tuple[float, int, int, _Entry]:
    """Heap item of a leaf: lowest priority first, then least recently used."""
    return (entry.priority, entry.last_used, id(entry), entry)
