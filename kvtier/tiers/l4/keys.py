"""The L4 key layout in Redis, and the URL as it may be shown.

Every key starts with `kvtier:` and carries a Redis Cluster hash tag (the part in braces), so
that the keys one operation touches together always sit in one hash slot:

- a chunk: `kvtier:c:{<32 hex digits of the chunk key>}`; while it is written, its value sits
  under `kvtier:c:{<same>}:tmp:<random>` and is RENAMEd over the chunk key in one MULTI/EXEC.
  The temp key shares the chunk's tag, so the rename stays inside one slot. Chunk keys are
  digests, so chunks spread evenly over the slots of a cluster.
- a session record: `kvtier:s:{<32 hex digits>}`, the digest of (model fingerprint, tenant,
  session id); its temp key is `kvtier:s:{<same>}:tmp:<random>` likewise.
- a tenant's data keys (encrypted stores only): `kvtier:k:{<32 hex digits>}`, the digest of
  the tenant, a hash of key id -> the data key wrapped by the master key (kvtier.tiers.l4.sealed).

Nothing is ever written to two slots in one command, so the layout works on one Redis and on a
Redis Cluster alike. Tenants never share a key: chunk keys already hash the tenant's namespace
(kvtier.cache.keys), and a record's digest hashes its tenant.
"""

from __future__ import annotations

import hashlib
import secrets
from urllib.parse import urlsplit, urlunsplit

PREFIX = "kvtier:"


def chunk(key: bytes) -> str:
    return f"{PREFIX}c:{{{key.hex()}}}"


def record_digest(fingerprint: bytes, tenant: str, session_id: str) -> str:
    h = hashlib.blake2b(digest_size=16)
    for part in (fingerprint, tenant.encode("utf-8", "surrogatepass")):
        h.update(len(part).to_bytes(4, "little"))
        h.update(part)
    h.update(session_id.encode("utf-8", "surrogatepass"))
    return h.hexdigest()


def record(fingerprint: bytes, tenant: str, session_id: str) -> str:
    return f"{PREFIX}s:{{{record_digest(fingerprint, tenant, session_id)}}}"


def tenant_keys(tenant: str) -> str:
    h = hashlib.blake2b(b"kvtier.l4.tenant\x00" + tenant.encode("utf-8", "surrogatepass"),
                        digest_size=16)  # fmt: skip
    return f"{PREFIX}k:{{{h.hexdigest()}}}"


def temp(final: str) -> str:
    """A temp key in the same hash slot as `final` (same hash tag)."""
    return f"{final}:tmp:{secrets.token_hex(8)}"


def redact(url: str) -> str:
    """The URL without its password (and user), for logs, stats and errors."""
    try:
        parts = urlsplit(url)
    except ValueError:
        return "<unparsable url>"
    if parts.password is None and parts.username is None:
        return url
    host = parts.hostname or ""
    if ":" in host:
        host = f"[{host}]"
    netloc = f"{host}:{parts.port}" if parts.port else host
    return urlunsplit((parts.scheme, netloc, parts.path, parts.query, parts.fragment))
