"""Page chains: the chained BLAKE3 keys of a prompt's pages (one pass over its tokens).

A page's key chains the BLAKE3 identity::

    key(page i) = BLAKE3(domain, namespace, key(page i-1), tokens of page i)

so two prompts that agree on their first ``i`` pages compute the same first ``i`` keys, and any
difference before a page changes its key and every key after it. The last partial page of a
prompt has an exact-length *tail* key chained the same way, and the whole prompt an *exact* key
(for frames that cannot be cut into rows).
"""

from __future__ import annotations

from collections.abc import Sequence

import attrs
import blake3
import numpy as np
import numpy.typing as npt

from stage_runtime.errors import ConfigError
from stage_runtime.identity import TokenArray, _frozen, as_token_array

__all__ = ["PageChain", "page_chain"]

_PAGE_DOMAIN = b"stage-runtime/activation-page-v1"
_TAIL_DOMAIN = b"stage-runtime/activation-tail-v1"
_EXACT_DOMAIN = b"stage-runtime/activation-exact-v1"
_ROOT_DOMAIN = b"stage-runtime/activation-root-v1"


def _private_tokens(tokens: Sequence[int] | npt.NDArray[np.integer]) -> TokenArray:
    """Validated int32 tokens the caller cannot change under us: the caller's own array when
    it is read-only and owns its memory (the pipeline's, shared by every stage), else a
    read-only private copy.

    A chain is remembered between a restore and the record of the same prompt; if it viewed the
    caller's buffer, reusing that buffer for the next prompt would silently change it.
    """
    ids = as_token_array(tokens)
    if isinstance(tokens, np.ndarray) and np.may_share_memory(ids, tokens):
        if ids is tokens and _frozen(tokens):
            return ids
        ids = ids.copy()
    ids.flags.writeable = False
    return ids


@attrs.frozen(kw_only=True, eq=False)
class PageChain:
    """The chained keys of one prompt under one namespace (computed once, in one pass)."""

    namespace: bytes
    """Identity of everything but the tokens (stage, model, width, salt...)."""
    label: str
    """Human-readable prefix of entry names in logs and eviction reports."""
    page_tokens: int
    """Tokens per page."""
    tokens: npt.NDArray[np.int32]
    """The prompt, read-only int32."""
    root_key: bytes
    """Parent key of the first page (a digest of the namespace)."""
    page_keys: tuple[bytes, ...]
    """Key of each full page, in order."""
    tail_key: bytes | None
    """Key of the partial last page, or ``None`` when the prompt ends on a page boundary."""
    exact_key: bytes
    """Key of the whole prompt as one exact-length entry (for frames that cannot be paged)."""

    @property
    def token_count(self) -> int:
        """Tokens in the prompt."""
        return int(self.tokens.size)

    def parent_key(self, page_index: int) -> bytes:
        """Key of the entry before page (or tail) ``page_index``."""
        return self.root_key if page_index == 0 else self.page_keys[page_index - 1]

    def segments(self, token_count: int) -> list[tuple[bytes, npt.NDArray[np.int32]]]:
        """``(parent key, tokens)`` of each page segment of the first ``token_count`` tokens."""
        p = self.page_tokens
        out = [
            (self.parent_key(i), self.tokens[i * p : (i + 1) * p]) for i in range(token_count // p)
        ]
        if token_count % p:
            i = token_count // p
            out.append((self.parent_key(i), self.tokens[i * p : token_count]))
        return out


def page_chain(
    namespace: bytes,
    tokens: Sequence[int] | npt.NDArray[np.integer],
    *,
    page_tokens: int,
    label: str = "act",
) -> PageChain:
    """Compute the chained page keys of ``tokens`` (one BLAKE3 pass over the tokens).

    Args:
        namespace: identity bytes of everything that is not a token (must differ between stages,
            widths, tenants...).
        tokens: integer token ids (any 1-D integer sequence; hashed as int32 little-endian).
        page_tokens: tokens per page, >= 1.
        label: prefix of entry names.

    Raises:
        ConfigError: ``page_tokens`` < 1 or tokens that are not 1-D int32-range integers.
    """
    if page_tokens < 1:
        msg = f"page_tokens must be >= 1, got {page_tokens}"
        raise ConfigError(msg)
    return _page_chain(namespace, _private_tokens(tokens), page_tokens, label, None)


_RECENT_CHAINS = 256
"""Recent prompts :meth:`PagedActivationIndex.chain` remembers to reuse their leading keys."""


def _page_chain(
    namespace: bytes,
    ids: TokenArray,
    page_tokens: int,
    label: str,
    recent: dict[bytes, PageChain] | None,
) -> PageChain:
    """:func:`page_chain` of validated private tokens.

    With ``recent`` (earlier chains by their first page key), the keys of the leading pages this
    prompt shares token for token with the latest earlier prompt that starts with the same page
    (same namespace and page size) are taken from that chain instead of hashed again: they are
    the same bytes either way. ``recent`` then remembers this chain (bounded, oldest dropped).
    """
    root = blake3.blake3(_ROOT_DOMAIN)
    root.update(namespace)
    root_key = root.digest()
    raw = ids.data.cast("B")
    width = 4 * page_tokens
    keys: list[bytes] = []
    parent = root_key
    n = int(ids.size)
    full = n // page_tokens
    hasher = blake3.blake3
    start = 0
    like: PageChain | None = None
    if recent is not None and full:
        parent = hasher(b"".join((_PAGE_DOMAIN, parent, raw[:width]))).digest()
        keys.append(parent)
        start = 1
        like = recent.pop(parent, None)
        if like is not None and like.namespace == namespace and like.page_tokens == page_tokens:
            end = min(full, len(like.page_keys)) * page_tokens
            if end > page_tokens:
                differ = np.flatnonzero(ids[page_tokens:end] != like.tokens[page_tokens:end])
                same = (page_tokens + int(differ[0]) if differ.size else end) // page_tokens
                if same > 1:
                    keys.extend(like.page_keys[1:same])
                    parent = keys[-1]
                    start = same
    for i in range(start, full):
        # One call per page over the concatenation (the same digest as three updates).
        parent = hasher(b"".join((_PAGE_DOMAIN, parent, raw[i * width : (i + 1) * width]))).digest()
        keys.append(parent)
    tail_key = None
    if n % page_tokens:
        h = blake3.blake3(_TAIL_DOMAIN)
        h.update(parent)
        h.update(raw[full * width :])
        tail_key = h.digest()
    exact = blake3.blake3(_EXACT_DOMAIN)
    exact.update(parent)
    exact.update(n.to_bytes(8, "little"))
    exact.update(raw[full * width :])
    chain = PageChain(
        namespace=namespace,
        label=label,
        page_tokens=page_tokens,
        tokens=ids,
        root_key=root_key,
        page_keys=tuple(keys),
        tail_key=tail_key,
        exact_key=exact.digest(),
    )
    if recent is not None and keys:
        recent[keys[0]] = chain
        if len(recent) > _RECENT_CHAINS:
            del recent[next(iter(recent))]
    return chain
