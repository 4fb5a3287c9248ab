"""What a stage cache hands back: identities, restores and records (spec §1.1, §5, §9.3).

Both indexes reply with these types, so the cache actor, the stage and the pipeline never know
which index they talk to.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Protocol

import attrs
import numpy as np
import numpy.typing as npt

from stage_runtime.cache.resident import EvictedEntry
from stage_runtime.config import MessageBase, StageConfig
from stage_runtime.frames import ActivationDesc, ActivationFrame
from stage_runtime.identity import (
    RUNTIME_ABI_VERSION,
    TokenArray,
    page_id,
    prefix_namespace_hash,
)

__all__ = [
    "ActivationRecordSummary",
    "ActivationRestore",
    "PageSource",
    "PageIdentity",
    "PrefillKvIdentity",
    "ResidentActivationRecord",
    "ResidentActivationRestore",
    "prefill_kv_identity",
    "summarize_records",
]


@attrs.frozen(kw_only=True)
class PageIdentity:
    """Metadata describing a cached page (spec §1.1); only ``prefix_hash`` is a hash."""

    model_id: str
    model_revision: str = "unknown"
    runtime_abi_version: str = RUNTIME_ABI_VERSION
    topology_id: str
    stage_id: str
    stage_index: int
    layer_start: int
    layer_end: int
    prefix_hash: str
    """``"blake3:"`` + 64 hex digits over the identity stream and the prefix tokens."""
    session_id: str
    """The requesting session: metadata only, never hashed (prefixes are shared)."""
    token_start: int
    token_count: int
    """Length of the prefix."""
    generation: int = 1
    layout: str = "layer-contiguous"
    codec: str = "fp16"
    tokenizer_id: str
    """``MessageBase.tokenizer_id``, or the model id when absent."""
    chat_template_id: str
    """``MessageBase.chat_template_id`` or ``""``."""
    position_config_hash: str
    """``"ctx:{ctx_size}"``."""
    kv_dtype: str = "ggml-native-kv"


@attrs.frozen(kw_only=True, eq=False)
class PrefillKvIdentity:
    """The identity of one prefix of a prompt on one stage."""

    identity: PageIdentity
    """Descriptive metadata, including the prefix hash and token count."""

    page_id: str
    """``"{stage}:{start}:{count}:{layer_start}:{digest16}"``."""

    namespace: str
    """:func:`~stage_runtime.identity.prefix_namespace_hash` of the stage and cache namespace."""

    token_ids: TokenArray
    """The prefix's tokens: a read-only view, not a copy."""


@attrs.frozen(kw_only=True, eq=False)
class ResidentActivationRestore:
    """A validated hit: the longest cached prefix of the prompt."""

    identity: PrefillKvIdentity
    """Identity of the restored prefix."""

    page_id: str
    """The cache key that hit (``"act:...:w{width}"``)."""

    token_count: int
    """Tokens restored."""

    payload_bytes: int
    """Bytes of the restored frame."""

    entries: int
    """Entries resident at lookup time."""

    frame: ActivationFrame
    """The restored frame (shared with the cache, read-only)."""


@attrs.frozen(kw_only=True)
class ResidentActivationRecord:
    """One prefix length stored by a record call."""

    page_id: str
    """The cache key (``"act:...:w{width}"``)."""

    token_count: int
    """Tokens of this prefix."""

    payload_bytes: int
    """Bytes of this prefix's frame."""

    evicted_entries: int
    """Entries this store evicted."""

    evicted_bytes: int
    """Bytes this store evicted."""

    entries: int
    """Entries resident after this store."""

    resident_bytes: int
    """Bytes resident after this store."""

    evicted: Sequence[EvictedEntry] = ()
    """The entries this store evicted, least recently used first (a tuple from the ladder; from the
    paged index, an ``EvictedPages`` that builds each record when read, which ``attrs.asdict``
    leaves as it is: ``tuple(record.evicted)`` gives a plain tuple)."""


class PageSource(Protocol):
    """What a paged hit hands over: its pages' payloads, and their join on demand."""

    @property
    def pages(self) -> tuple[npt.NDArray[np.uint8], ...]:
        """Read-only payload views, in token order."""
        ...

    @property
    def page_token_counts(self) -> tuple[int, ...]:
        """Tokens in each page."""
        ...

    def payload(self) -> npt.NDArray[np.uint8]:
        """The pages joined (at most one copy)."""
        ...

    def copy_bytes(self) -> int:
        """Bytes :meth:`payload` copies."""
        ...


IdentityInputs = tuple[StageConfig, MessageBase, int, TokenArray, int, str]
"""The arguments of :func:`prefill_kv_identity`: stage, message, first token's position, the
prompt's tokens (read-only), restored count and prefix hash."""


@attrs.frozen(kw_only=True, eq=False)
class ActivationRestore:
    """A hit of either index: the restored prefix, as its pages or as one frame on demand.

    The ladder restores one cached frame (``whole``); the paged index a run of pages
    (``source``), joined only when :meth:`frame` is called. Nothing is copied until then.
    """

    page_id: str
    """The cache key that hit (the ladder), or the name of the last page used (paged)."""
    token_count: int
    """Tokens restored."""
    payload_bytes: int
    """Bytes of the restored prefix."""
    entries: int
    """Entries resident at restore time."""
    desc: ActivationDesc
    """Descriptor of the whole restored prefix."""
    source: PageSource | None = None
    """A paged hit's pages; None for a ladder hit."""
    whole: ActivationFrame | None = None
    """A ladder hit's cached frame (shared with the cache, read-only); None for a paged hit."""
    _identity: PrefillKvIdentity | None = attrs.field(default=None, alias="identity")
    _identity_of: IdentityInputs | None = attrs.field(default=None, alias="identity_of", repr=False)

    def __attrs_post_init__(self) -> None:
        if (self._identity is None) == (self._identity_of is None):
            msg = "an ActivationRestore takes exactly one of identity and identity_of"
            raise TypeError(msg)

    @property
    def identity(self) -> PrefillKvIdentity:
        """Identity of the restored prefix (a paged hit's prefix hash is a digest of its chained
        page key).

        Given as ``identity``, or as ``identity_of``: the arguments of
        :func:`prefill_kv_identity`, called when this is first read (a stage never reads it)."""
        identity = self._identity
        if identity is None:
            inputs = self._identity_of
            if inputs is None:  # another thread has just computed it (and set it first)
                identity = self._identity
                assert identity is not None
                return identity
            identity = prefill_kv_identity(*inputs)
            object.__setattr__(self, "_identity", identity)
            object.__setattr__(self, "_identity_of", None)  # (one of the two, as given)
        return identity

    def pages(self) -> tuple[ActivationFrame, ...]:
        """The pages in token order, one frame each, viewing the cached rows (never copied)."""
        if self.source is None:
            assert self.whole is not None
            return (self.whole,)
        return tuple(
            ActivationFrame(
                desc=attrs.evolve(self.desc, token_count=count, payload_bytes=int(payload.size)),
                payload=payload,
            )
            for count, payload in zip(self.source.page_token_counts, self.source.pages, strict=True)
        )

    def copy_bytes(self) -> int:
        """Bytes :meth:`frame` copies: none for a ladder hit, one page, or virtual rows."""
        return 0 if self.source is None else self.source.copy_bytes()

    def frame(self) -> ActivationFrame:
        """The whole prefix as one frame: at most one copy (see :meth:`copy_bytes`)."""
        if self.source is None:
            assert self.whole is not None
            return self.whole
        return ActivationFrame(desc=self.desc, payload=self.source.payload())

    def to_restore(self) -> ResidentActivationRestore:
        """The same hit as the seed-parity API's result (the frame assembled)."""
        return ResidentActivationRestore(
            identity=self.identity,
            page_id=self.page_id,
            token_count=self.token_count,
            payload_bytes=self.payload_bytes,
            entries=self.entries,
            frame=self.frame(),
        )


@attrs.frozen(kw_only=True)
class ActivationRecordSummary:
    """Totals over the records of one record call (the upstream's reply statistics)."""

    recorded_frames: int
    recorded_bytes: int
    evicted_entries: int
    evicted_bytes: int


def summarize_records(records: Iterable[ResidentActivationRecord]) -> ActivationRecordSummary:
    """Sum frames, bytes and evictions over records (binary transport statistics, spec §9.3)."""
    frames = recorded = entries = evicted = 0
    for record in records:
        frames += 1
        recorded += record.payload_bytes
        entries += record.evicted_entries
        evicted += record.evicted_bytes
    return ActivationRecordSummary(
        recorded_frames=frames,
        recorded_bytes=recorded,
        evicted_entries=entries,
        evicted_bytes=evicted,
    )


def _readonly(array: TokenArray) -> TokenArray:
    view = array.view()
    view.flags.writeable = False
    return view


def prefill_kv_identity(
    config: StageConfig,
    base: MessageBase,
    token_start: int,
    tokens: TokenArray,
    count: int,
    hash_: str,
) -> PrefillKvIdentity:
    """The identity of ``tokens[:count]`` on ``config``'s stage, whose prefix hash is ``hash_``."""
    namespace = base.chat_template_id
    identity = PageIdentity(
        model_id=config.model_id,
        topology_id=config.topology_id,
        stage_id=config.stage_id,
        stage_index=config.stage_index,
        layer_start=config.layer_start,
        layer_end=config.layer_end,
        prefix_hash=hash_,
        session_id=base.session_id,
        token_start=token_start,
        token_count=count,
        tokenizer_id=base.tokenizer_id if base.tokenizer_id is not None else config.model_id,
        chat_template_id=namespace or "",
        position_config_hash=f"ctx:{config.ctx_size}",
    )
    return PrefillKvIdentity(
        identity=identity,
        page_id=page_id(config, token_start, count, hash_),
        namespace=prefix_namespace_hash(config, token_start, namespace),
        token_ids=_readonly(tokens[:count]),
    )
