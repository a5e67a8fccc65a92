"""Chunk keys: a hash chain over token ids, namespaced by model fingerprint and tenant.

key(chunk i) = blake2b(key(chunk i-1) || token ids of chunk i || namespace), 16 bytes.
Equal prefixes under one namespace give equal keys (sessions share them); another tenant's
namespace gives different keys for the same tokens, so tenants never share a chunk (and cannot
probe each other's prefixes by timing) unless a prefix is published into the shared namespace.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Sequence

ZERO_KEY = bytes(16)
# The tenant of explicitly published prefixes. It must fit a .kvbin header (UTF-8, no NUL);
# `TieredCache.session` refuses it as a client tenant name.
SHARED_TENANT = "kvtier#shared"  # "#": outside the server's tenant alphabet
TENANT_MAX_BYTES = 64  # a .kvbin header holds at most this many UTF-8 bytes of tenant


def namespace(fingerprint: bytes, tenant: str) -> bytes:
    return hashlib.blake2b(
        fingerprint + b"\x00" + tenant.encode("utf-8", "surrogatepass"), digest_size=16
    ).digest()


def token_bytes(tokens: Sequence[int]) -> bytes:
    return array("i", tokens).tobytes()


def chunk_key(parent: bytes, tokens: Sequence[int], ns: bytes) -> bytes:
    h = hashlib.blake2b(digest_size=16)
    h.update(parent)
    h.update(len(tokens).to_bytes(4, "little"))
    h.update(token_bytes(tokens))
    h.update(ns)
    return h.digest()


def chain(tokens: Sequence[int], chunk_tokens: int, ns: bytes, parent: bytes = ZERO_KEY):
    """Yield (index, key) of each full chunk of `tokens`."""
    for i in range(len(tokens) // chunk_tokens):
        parent = chunk_key(parent, tokens[i * chunk_tokens : (i + 1) * chunk_tokens], ns)
        yield i, parent
