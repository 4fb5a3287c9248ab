"""Page chains: the chained BLAKE3 keys of a prompt's pages (one pass over its tokens, once per
request for every stage; the exact key, which few prompts need, is computed when first read).

A page's key has two parts: a *token key* chained over the tokens alone, the same for every
stage, tenant and width, and the namespace's *tag* (everything else a key depends on)::

    token key(page i) = BLAKE3(page domain, token key(page i-1), tokens of page i)
    key(page i)       = token key(page i) + tag       (tag: 16 bytes of the namespace's root key)

(the token key before page 0 is a constant). Entry names and a hit's prefix hash show a digest
of the whole key (:func:`key_digest`), so one prompt is named apart in each namespace.

so two prompts that agree on their first ``i`` pages compute the same first ``i`` keys, and any
difference before a page changes its key and every key after it. The last partial page of a
prompt has an exact-length *tail* key chained the same way, and the whole prompt an *exact* key
(for frames that cannot be cut into rows). The token keys of a prompt are computed once, and
every stage (every namespace) that pages the same prompt array by the same page size takes
them (:func:`_token_chain`): hashing small pages one after the other is slow in BLAKE3 (no SIMD
across pages), so this is most of what a paged stage cache costs.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

import attrs
import blake3
import numpy as np
import numpy.typing as npt

from stage_runtime._arrays import first_difference
from stage_runtime.errors import ConfigError
from stage_runtime.identity import TokenArray, _frozen, as_token_array

__all__ = ["PageChain", "key_digest", "page_chain"]

_PAGE_DOMAIN = b"stage-runtime/activation-page-v1"
_TAIL_DOMAIN = b"stage-runtime/activation-tail-v1"
_EXACT_DOMAIN = b"stage-runtime/activation-exact-v1"
_ROOT_DOMAIN = b"stage-runtime/activation-root-v1"
_TOKEN_ROOT = blake3.blake3(b"stage-runtime/activation-token-root-v1").digest()
"""Parent token key of a prompt's first page."""
TAG_BYTES = 16
"""Bytes of the namespace's root key appended to every token key."""


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


class TokenChain:
    """The token keys of one prompt by one page size (shared by every namespace that pages it;
    not to be changed but for the page keys it remembers, :attr:`tagged`)."""

    __slots__ = (
        "_exact",
        "page_keys",
        "page_tokens",
        "tagged",
        "tail_key",
        "token_count",
        "tokens",
    )

    def __init__(
        self,
        tokens: TokenArray,
        page_tokens: int,
        page_keys: tuple[bytes, ...],
        tail_key: bytes | None,
    ) -> None:
        self.tokens = tokens
        """The prompt, read-only int32."""
        self.page_tokens = page_tokens
        self.page_keys = page_keys
        """Token key of each full page, in order."""
        self.tail_key = tail_key
        """Token key of the partial last page, or None when the prompt ends on a page boundary."""
        self.token_count = int(tokens.size)
        self._exact: bytes | None = None
        self.tagged: dict[bytes, tuple[bytes, ...]] = {}
        """The page keys made of these token keys so far, by namespace tag (:func:`_page_chain`):
        all of them, or the leading ones taken from the earlier chain these started like. (They
        keep their key objects alive while the chain is remembered, evicted pages' too: some
        80 bytes a page and namespace.)"""

    @property
    def exact_key(self) -> bytes:
        """Token key of the whole prompt as one exact-length entry (computed when first read)."""
        key = self._exact
        if key is None:
            full = len(self.page_keys)
            parent = self.page_keys[-1] if full else _TOKEN_ROOT
            key = self._exact = _exact_key(parent, self.tokens, full * self.page_tokens)
        return key


@attrs.frozen(kw_only=True, eq=False)
class PageChain:
    """The chained keys of one prompt under one namespace (the token keys computed once per
    prompt and page size, for every namespace; the exact key when first read)."""

    namespace: bytes
    """Identity of everything but the tokens (stage, model, width, salt...)."""
    label: str
    """Human-readable prefix of entry names in logs and eviction reports."""
    page_tokens: int
    """Tokens per page."""
    tokens: npt.NDArray[np.int32]
    """The prompt, read-only int32."""
    root_key: bytes
    """A digest of the namespace: its first :data:`TAG_BYTES` bytes end every key of the chain,
    and it stands for the first page's parent where entries are grouped by parent (the
    footprint)."""
    page_keys: tuple[bytes, ...]
    """Key of each full page, in order."""
    tail_key: bytes | None
    """Key of the partial last page, or ``None`` when the prompt ends on a page boundary."""
    token_chain: TokenChain
    """The token keys the keys are made of."""
    _exact_key: bytes | None = attrs.field(default=None, alias="exact_key")
    """:attr:`exact_key` once computed (most prompts never need it)."""

    @property
    def exact_key(self) -> bytes:
        """Key of the whole prompt as one exact-length entry (for frames that cannot be paged).

        Computed when first read: only a frame that cannot be paged is stored under it, and a
        restore looks it up only while such an entry is resident."""
        key = self._exact_key
        if key is None:
            key = self.token_chain.exact_key + self.root_key[:TAG_BYTES]
            object.__setattr__(self, "_exact_key", key)
        return key

    @property
    def token_count(self) -> int:
        """Tokens in the prompt."""
        return int(self.tokens.size)

    def parent_key(self, page_index: int) -> bytes:
        """Key of the entry before page (or tail) ``page_index`` (:attr:`root_key` before the
        first): what groups entries by parent."""
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
    """Compute the chained page keys of ``tokens`` (one BLAKE3 pass over the tokens; the
    exact key is computed when first read).

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
    return _page_chain(namespace, _private_tokens(tokens), page_tokens, label, None, shared=False)


def key_digest(key: bytes) -> bytes:
    """A 32-byte digest of an entry's key, token and namespace parts alike: what names it in
    logs (its first 8 bytes) and a hit's prefix hash."""
    return blake3.blake3(key).digest()


def _exact_key(parent: bytes, tokens: TokenArray, start: int) -> bytes:
    """The exact key of ``tokens``: chained after ``parent``, the key of their last full page
    (which ends at token ``start``)."""
    exact = blake3.blake3(_EXACT_DOMAIN)
    exact.update(parent)
    exact.update(int(tokens.size).to_bytes(8, "little"))
    exact.update(tokens[start:].data.cast("B"))
    return exact.digest()


_RECENT_CHAINS = 768
"""Chains :class:`RecentChains` keeps at most (and :data:`_RECENT_TOKENS` tokens at most). On the
synthetic trace a stage hashes 16.4 of a request's 29.5 pages again with 256, 11.0 with 768
and 10.5 with 1,024 (10.1 are shared by no earlier prompt); each prompt remembered keeps its
tokens (the pipeline's array, one for every stage): 768 cost the command line's paged replay
about 35 MB of peak RSS over 256."""

_RECENT_TOKENS = 1 << 24
"""Tokens the chains a :class:`RecentChains` keeps may hold in all: 64 MiB of token ids (4 bytes
each), so that long prompts (a private copy each, when their array is not the pipeline's) keep
it bounded. Their keys come on top, about 73 bytes per page (a 32-byte digest object and its
tuple slot): more than the tokens themselves with 16-token pages, 14% more with the stride the
runtime pages by default (128 tokens), 4% with the simulator's 512."""


class RecentChains:
    """The token chains computed lately by one index, by first page key, oldest first: a new
    prompt takes the keys of the leading pages it shares with the latest one that starts like
    it."""

    __slots__ = ("_chains", "_tokens")

    def __init__(self) -> None:
        self._chains: dict[bytes, TokenChain] = {}
        self._tokens = 0

    def __len__(self) -> int:
        return len(self._chains)

    def take(self, first_key: bytes) -> TokenChain | None:
        """The chain remembered under ``first_key``, forgotten (its successor replaces it)."""
        chain = self._chains.pop(first_key, None)
        if chain is not None:
            self._tokens -= chain.token_count
        return chain

    def remember(self, chain: TokenChain) -> None:
        """Keep ``chain`` (it has a full page) as the newest; drop the oldest past the bounds."""
        chains = self._chains
        first = chain.page_keys[0]
        earlier = chains.pop(first, None)
        if earlier is not None:
            self._tokens -= earlier.token_count
        chains[first] = chain
        self._tokens += chain.token_count
        while len(chains) > _RECENT_CHAINS or (self._tokens > _RECENT_TOKENS and len(chains) > 1):
            oldest = chains.pop(next(iter(chains)))
            self._tokens -= oldest.token_count


_ROOT_KEYS = 64
_root_keys: dict[bytes, bytes] = {}
"""The root key of each namespace seen lately (a namespace is one stage's identity)."""


def _root_key(namespace: bytes) -> bytes:
    if type(namespace) is not bytes:  # a bytearray, or any buffer, hashes as its bytes
        namespace = bytes(memoryview(namespace))
    key = _root_keys.get(namespace)
    if key is None:
        if len(_root_keys) >= _ROOT_KEYS:
            _root_keys.clear()
        root = blake3.blake3(_ROOT_DOMAIN)
        root.update(namespace)
        key = _root_keys[namespace] = root.digest()
    return key


def _page_chain(
    namespace: bytes,
    ids: TokenArray,
    page_tokens: int,
    label: str,
    recent: RecentChains | None,
    *,
    shared: bool,
) -> PageChain:
    """:func:`page_chain` of validated private tokens: the token keys (:func:`_token_chain`;
    ``shared``: the chain made lately for the same array, when there is one) with the
    namespace's tag."""
    root_key = _root_key(namespace)
    tag = root_key[:TAG_BYTES]
    tokens = _token_chain(ids, page_tokens, recent, shared=shared)
    tail = tokens.tail_key
    # The keys of the pages shared with the earlier chain are that chain's key objects: not
    # made again, and an index that stored them finds them by identity, without comparing
    # their bytes.
    tagged = tokens.tagged
    page_keys = tagged.get(tag, ())
    if len(page_keys) < len(tokens.page_keys):
        made = len(page_keys)
        page_keys += tuple([key + tag for key in tokens.page_keys[made:]])
        if len(tagged) >= _TAGS:
            tagged.clear()
        tagged[tag] = page_keys
    return PageChain(
        namespace=namespace,
        label=label,
        page_tokens=page_tokens,
        tokens=ids,
        root_key=root_key,
        page_keys=page_keys,
        tail_key=None if tail is None else tail + tag,
        token_chain=tokens,
    )


_TAGS = 16
"""Namespaces a :class:`TokenChain` keeps the page keys of (a pipeline's stages page one prompt
array each in its own; past that it starts again)."""

_SHARED_CHAINS = 16
_shared_chains: OrderedDict[tuple[int, int], TokenChain] = OrderedDict()
"""The token chains made lately of callers' read-only arrays, by ``(id(tokens), page_tokens)``,
oldest first: the stages of a pipeline page the same prompt array one after the other. (Each
chain holds its array, so the id cannot be reused while it is here.) As the stage cache's
prompt and grid memos do, this takes a read-only array that owns its memory for one that never
changes (:func:`~stage_runtime.cache.prompt.owned_tokens`)."""


def _token_chain(
    ids: TokenArray, page_tokens: int, recent: RecentChains | None, *, shared: bool
) -> TokenChain:
    """The token keys of ``ids`` (validated, private: see :func:`_private_tokens`); with
    ``shared``, the chain made lately for the same array and page size when there is one (and
    this one is kept for the next caller).

    With ``recent`` (earlier chains by their first page key), the keys of the leading pages this
    prompt shares token for token with the latest earlier prompt that starts with the same page
    (and page size) are taken from that chain instead of hashed again: they are the same bytes
    either way. ``recent`` then remembers this chain (bounded, oldest dropped).
    """
    memo_key = (id(ids), page_tokens)
    if shared:
        chain = _shared_chains.get(memo_key)
        if chain is not None and chain.tokens is ids:
            return chain
    raw = ids.data.cast("B")
    width = 4 * page_tokens
    keys: list[bytes] = []
    parent = _TOKEN_ROOT
    tagged: dict[bytes, tuple[bytes, ...]] = {}
    n = int(ids.size)
    full = n // page_tokens
    hasher = blake3.blake3
    start = 0
    if recent is not None and full:
        parent = hasher(b"".join((_PAGE_DOMAIN, parent, raw[:width]))).digest()
        keys.append(parent)
        start = 1
        like = recent.take(parent)
        if like is not None and like.page_tokens == page_tokens:
            end = min(full, len(like.page_keys)) * page_tokens
            if end > page_tokens:
                common = first_difference(ids[page_tokens:end], like.tokens[page_tokens:end])
                same = (page_tokens + common) // page_tokens
                if same > 1:
                    keys.extend(like.page_keys[1:same])
                    parent = keys[-1]
                    start = same
            tagged = {tag: made[:start] for tag, made in like.tagged.items()}
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
    chain = TokenChain(ids, page_tokens, tuple(keys), tail_key)
    chain.tagged = tagged
    if recent is not None and keys:
        recent.remember(chain)
    if shared:
        _shared_chains[memo_key] = chain
        if len(_shared_chains) > _SHARED_CHAINS:
            _shared_chains.popitem(last=False)
    return chain
