"""Sealed L4 values: when the L3 store is encrypted (docs/security.md), every chunk value and
session record L4 holds is sealed exactly as L3 seals it, under the tenant's data key.

A data key lives, wrapped by the master key, in the L3 index of the host that made it. Hosts
share the master key, not their L3 roots, so a host that reads a value sealed elsewhere needs
the writer's data key: each writer publishes its tenant keys in Redis, wrapped by the master key
as in the index (`kvtier:k:{<tenant digest>}`, a hash of key id -> KEY_MAGIC, the master key's
id, nonce || wrapped key || tag; AES-GCM bound to the tenant and the key id). Nothing in Redis
opens without the master key.

`TenantKeys.by_id` finds a key in this host's keyring, then among the keys it read from Redis,
then in Redis. Crypto-shred deletes the tenant's hash (and its values) from Redis: a value left
behind names a key nobody can find any more and is a miss (`TenantKeyShredded`).
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from kvtier import sealing
from kvtier.errors import AuthenticationFailed, KvbinFormatError, TenantKeyShredded
from kvtier.kvbin import KEY_ID_SIZE, NONCE_SIZE, TAG_SIZE, ChunkHeader
from kvtier.sealing import DataKey, MasterKey, PayloadOpener

if TYPE_CHECKING:  # pragma: no cover
    from kvtier.tiers.l3.keys import Keyring
    from kvtier.tiers.l4.store import L4Store

log = logging.getLogger("kvtier.tiers.l4")
KEY_MAGIC = b"KVTKEY1\x00"
_MASTER_ID = 16  # bytes of the master key's id (32 hex digits)
KEY_VALUE_SIZE = len(KEY_MAGIC) + _MASTER_ID + NONCE_SIZE + sealing.KEY_BYTES + TAG_SIZE


class TenantKeys:
    """The data keys that seal and open one host's L4 values (thread-safe)."""

    def __init__(self, store: L4Store, keyring: Keyring, master: MasterKey) -> None:
        self._store = store
        self._keyring = keyring
        self._master = master
        self._master_id = bytes.fromhex(master.key_id)
        self._lock = threading.Lock()
        self._remote: dict[bytes, DataKey] = {}  # key id -> a key read from Redis
        self._published: dict[bytes, float] = {}  # key id -> when it was last put in Redis
        self._bufs = threading.local()  # per writer thread: a sealed payload's ciphertext
        ttl_s = None if store.ttl_ms is None else store.ttl_ms / 1000
        # republished well before Redis lets the hash expire (every put renews its TTL)
        self._refresh_s = 3600.0 if ttl_s is None else max(0.01, min(3600.0, ttl_s / 4))

    # -- sealing ---------------------------------------------------------------------------------

    def for_tenant(self, tenant: str) -> DataKey:
        """The tenant's data key (this host's, made on first use), published in Redis."""
        key = self._keyring.for_tenant(tenant)
        now = time.monotonic()
        with self._lock:
            last = self._published.get(key.key_id)
        if last is None or now - last >= self._refresh_s:
            wrapped = self._master.wrap(key.tenant, key.key_id, key.secret)
            self._put(key.tenant, key.key_id, KEY_MAGIC + self._master_id + wrapped)
            with self._lock:
                self._published[key.key_id] = now
        return key

    def _put(self, tenant: str, key_id: bytes, value: bytes) -> None:
        """HSET the wrapped key into the tenant's hash (its TTL renewed), through the store's
        breaker (L4Unavailable on trouble)."""
        self._store.put_tenant_key(tenant, key_id, value)

    def _get(self, tenant: str, key_id: bytes) -> bytes | None:
        return self._store.get_tenant_key(tenant, key_id)

    def seal(self, header: ChunkHeader, payload: Any) -> tuple[ChunkHeader, memoryview]:
        """A chunk sealed for L4 under its tenant's key, into this thread's buffer (valid until
        the thread's next seal): the sealed header and the ciphertext."""
        view = memoryview(payload).cast("B")
        buf: bytearray | None = getattr(self._bufs, "buf", None)
        if buf is None or len(buf) < len(view) + TAG_SIZE:
            buf = self._bufs.buf = bytearray(len(view) + TAG_SIZE)
        return seal_chunk(self.for_tenant(header.tenant), header, view, memoryview(buf))

    def republish(self) -> None:
        """Redis lost its data (a restart): put every key again with its next value."""
        with self._lock:
            self._published.clear()

    # -- opening ---------------------------------------------------------------------------------

    def by_id(self, key_id: bytes, tenant: str, *, fresh: bool = False) -> DataKey:
        """The data key `key_id` of `tenant`: this host's own, else one published in Redis
        (`fresh`: asked of Redis again, so a shred on another host is seen). Raises
        TenantKeyShredded when no key can be found or opened here (a miss, never a delete)."""
        key_id = bytes(key_id)
        if not fresh:
            with self._lock:
                key = self._remote.get(key_id)
            if key is not None and key.tenant == tenant:
                return key
        try:
            return self._keyring.by_id(key_id, tenant)
        except TenantKeyShredded:
            pass  # not this host's key (or destroyed here): Redis may hold it
        value = self._get(tenant, key_id)
        if value is None:
            with self._lock:
                self._remote.pop(key_id, None)
            raise TenantKeyShredded(
                f"data key {key_id.hex()} of tenant {tenant!r} is neither in this host's L3 "
                "nor in L4 (destroyed by a crypto-shred, or expired): the value is a miss and "
                "is recomputed"
            )
        key = self._unwrap(tenant, key_id, value)
        with self._lock:
            self._remote[key_id] = key
        return key

    def _unwrap(self, tenant: str, key_id: bytes, value: bytes) -> DataKey:
        if len(value) != KEY_VALUE_SIZE or not value.startswith(KEY_MAGIC):
            raise TenantKeyShredded(f"L4 entry of data key {key_id.hex()} is malformed")
        master_id = value[len(KEY_MAGIC) : len(KEY_MAGIC) + _MASTER_ID]
        if master_id != self._master_id:
            raise TenantKeyShredded(
                f"data key {key_id.hex()} of tenant {tenant!r} in L4 is wrapped by master key "
                f"{master_id.hex()}, this host has {self._master.key_id}: start every host "
                "sharing this Redis with the same --master-key-file"
            )
        try:
            return self._master.unwrap(tenant, key_id, value[len(KEY_MAGIC) + _MASTER_ID :])
        except AuthenticationFailed as exc:
            raise TenantKeyShredded(f"L4 entry of data key {key_id.hex()}: {exc}") from None

    def opener(self, header: ChunkHeader) -> PayloadOpener:
        """The in-place decryptor of a sealed L4 chunk (before its payload is read).

        A plain value in an encrypted deployment is refused (KvbinFormatError): it was not
        written by a host of this deployment and its bytes are not authenticated."""
        if not header.sealed:
            raise KvbinFormatError(
                f"L4 chunk {header.key.hex()} is not sealed but this store is encrypted: "
                "it was not written by a host with this master key"
            )
        if len(header.key_id) != KEY_ID_SIZE:  # pragma: no cover - kvbin.decode checks it
            raise KvbinFormatError(f"L4 chunk {header.key.hex()} has a bad key id")
        return PayloadOpener(self.by_id(header.key_id, header.tenant), header)

    def forget(self, tenant: str) -> None:
        """Drop every key of `tenant` this host read or published (its crypto-shred)."""
        with self._lock:
            for kid in [k for k, v in self._remote.items() if v.tenant == tenant]:
                del self._remote[kid]
            self._published.clear()


def seal_chunk(
    key: DataKey, header: ChunkHeader, payload: memoryview, out: memoryview
) -> tuple[ChunkHeader, memoryview]:
    """Seal `payload` into `out` (payload_len + 16 bytes) as L3 seals a chunk (same header
    fields, same associated data); returns the sealed header and the ciphertext's view."""
    n = len(payload)
    # a header read back from L3 is sealed already: sealed again here under a fresh nonce
    plain = replace(header, payload_len=n, encryption="none", key_id=b"", nonce=b"", tag=b"")
    sealed = sealing.seal_payload(key, plain, payload, out)
    return sealed, out[:n]


__all__ = ["KEY_MAGIC", "TenantKeys", "seal_chunk"]
