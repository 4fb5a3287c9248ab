"""The paged index: prompts that share a prefix share its pages.

The ladder index (spec §2.2, §5.2) stores each recorded prefix length as its own entry and can
hit only at the lengths it recorded. This index cuts a token-major activation into pages of
``page_tokens`` rows instead, keyed by chained BLAKE3 identities (:mod:`.chains`), so two prompts
that agree on their first pages share them, stored once whoever recorded them. Frames that are
not plain token rows (opaque layout, side-band flags) are kept whole as an *exact* entry.

- :mod:`.chains`: the keys of a prompt's pages;
- :mod:`.results`: what a restore and a record hand back;
- :mod:`.entries`: the resident entries;
- :mod:`.eviction`: which leaf goes first (least recently used, or least valuable by reuse);
- :mod:`.index`: :class:`PagedActivationIndex`, the pages themselves;
- :mod:`.stage_index`: :class:`PagedIndex`, the stage cache's index over it.
"""

from stage_runtime.cache.paged.chains import PageChain, page_chain
from stage_runtime.cache.paged.index import PagedActivationIndex
from stage_runtime.cache.paged.results import (
    EntryKind,
    EvictedPage,
    EvictedPages,
    PagedIndexStats,
    PagedLookup,
    PagedRecordOutcome,
    PagedRestore,
)
from stage_runtime.cache.paged.stage_index import PagedIndex

__all__ = [
    "EntryKind",
    "EvictedPage",
    "EvictedPages",
    "PageChain",
    "PagedActivationIndex",
    "PagedIndex",
    "PagedIndexStats",
    "PagedLookup",
    "PagedRecordOutcome",
    "PagedRestore",
    "page_chain",
]
