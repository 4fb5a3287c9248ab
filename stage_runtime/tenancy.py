"""Tenant isolation: the optional per-request ``cache_salt`` mixed into cache identities.

A shared prefix cache tells whoever can time a restore which prefixes others sent. A request that
carries ``MessageBase.cache_salt`` gets keys no request with another salt (or none) can compute:

- ladder index: each prefix hash becomes ``BLAKE3(domain, len(salt), salt, upstream hash)``;
- paged index: the salt joins the page namespace (:func:`paged_namespace`).

Without a salt both are exactly the unsalted identities, so the upstream's sharing across
sessions is unchanged. Salted and unsalted streams start with different domain tags, so no choice
of namespace string can make them collide.
"""

from __future__ import annotations

from collections.abc import Mapping

import blake3

from stage_runtime.config import MessageBase, StageConfig
from stage_runtime.errors import ConfigError
from stage_runtime.identity import prefix_namespace_hash

__all__ = ["paged_namespace", "salted_prefix_hash", "salted_prefix_hashes"]

_SALT_DOMAIN = b"stage-runtime/cache-salt-v1"
_NAMESPACE_DOMAIN = b"stage-runtime/paged-namespace-v1"


def _salt_bytes(salt: str) -> bytes:
    if not isinstance(salt, str) or not salt:
        # "" would be a tenant of its own, isolated from unsalted traffic (MessageBase refuses it)
        msg = f"cache_salt must be a non-empty string or None, got {salt!r}"
        raise ConfigError(msg)
    raw = salt.encode()
    return _SALT_DOMAIN + len(raw).to_bytes(8, "little") + raw


def salted_prefix_hash(prefix_hash: str, salt: str | None) -> str:
    """``prefix_hash`` itself without a salt, else a ``"blake3:"`` hash bound to the salt."""
    if salt is None:
        return prefix_hash
    h = blake3.blake3(_salt_bytes(salt))
    h.update(prefix_hash.encode())
    return "blake3:" + h.hexdigest()


def salted_prefix_hashes(hashes: Mapping[int, str], salt: str | None) -> dict[int, str]:
    """:func:`salted_prefix_hash` over a mapping of prefix lengths to hashes."""
    if salt is None:
        return dict(hashes)
    return {count: salted_prefix_hash(value, salt) for count, value in hashes.items()}


def paged_namespace(
    config: StageConfig,
    token_start: int,
    base: MessageBase,
    activation_width: int,
) -> bytes:
    """The namespace bytes of a stage's pages: stage identity, cache namespace, width and salt.

    Everything the upstream hashes before the tokens (spec §1.2, via
    :func:`~stage_runtime.identity.prefix_namespace_hash`), the activation width (the ladder's
    ``w{width}`` key suffix), and ``base.cache_salt`` when set.
    """
    h = blake3.blake3(_NAMESPACE_DOMAIN)
    h.update(prefix_namespace_hash(config, token_start, base.chat_template_id).encode())
    h.update(max(activation_width, 0).to_bytes(8, "little"))
    if base.cache_salt is not None:
        h.update(_salt_bytes(base.cache_salt))
    return h.digest()
