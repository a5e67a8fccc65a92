"""The L3 store's keyring: each tenant's data key, wrapped by the master key in the index.

An encrypted store records its master key's id (`master_key_id` in the index's meta table) when
it is created; an open with another key, or with none where one is needed, is refused before
anything is read or deleted. Data keys are made on a tenant's first write and kept unwrapped in
memory only. `shred` deletes a tenant's wrapped key and session records in one transaction with
SQLite's secure_delete on, then checkpoints the WAL: every chunk and record the key sealed is
unreadable from then on, and `kvtier l3 gc` removes the files (docs/security.md).
"""

from __future__ import annotations

import threading
import time

from kvtier.errors import (
    EncryptionError,
    MasterKeyError,
    MasterKeyRequired,
    TenantKeyShredded,
)
from kvtier.sealing import DataKey, MasterKey
from kvtier.tiers.l3.index import _ROW_COLS, ChunkRow, Index, _row

MASTER_KEY_ID = "master_key_id"  # meta row: the id of the master key the store was made with


def check_master_key(
    index: Index, master: MasterKey | None, *, need_key: bool, writable: bool
) -> str | None:
    """The store's recorded master key id after checking `master` against it (recording it
    in a new, empty store). Raises MasterKeyError / MasterKeyRequired / EncryptionError."""
    recorded = index.get_meta(MASTER_KEY_ID)
    root = index.path.parent
    if master is None:
        if recorded is not None and need_key:
            raise MasterKeyRequired(
                f"the L3 store at {root} is encrypted (master key id {recorded}); start with "
                "--encrypt --master-key-file PATH (or KVTIER_MASTER_KEY_FILE) naming that key. "
                "Nothing was read or deleted"
            )
        return recorded
    if recorded is None:
        chunks, _ = index.totals()
        if chunks or index.session_count():
            raise EncryptionError(
                f"the L3 store at {root} holds unencrypted chunks or sessions; encryption is "
                "chosen when a store is created: use a new --l3-root for an encrypted store, "
                "or run without --encrypt"
            )
        if not writable:
            return None
        index.set_meta(MASTER_KEY_ID, master.key_id)
        return master.key_id
    if recorded != master.key_id:
        raise MasterKeyError(
            f"wrong master key for the L3 store at {root}: {master.source or 'the key given'} "
            f"has id {master.key_id}, the store was created with {recorded}. Pass the key the "
            "store was created with; nothing was read or deleted"
        )
    return recorded


class Keyring:
    """Tenant data keys of one encrypted store (thread-safe)."""

    def __init__(self, index: Index, master: MasterKey | None) -> None:
        self._index = index
        self._master = master
        self._lock = threading.Lock()
        self._by_id: dict[bytes, DataKey] = {}
        self._by_tenant: dict[str, DataKey] = {}

    @property
    def locked(self) -> bool:
        """No master key: keys can be destroyed but not used (maintenance commands)."""
        return self._master is None

    def _need_master(self) -> MasterKey:
        if self._master is None:
            raise MasterKeyRequired(
                f"the L3 store at {self._index.path.parent} is encrypted and was opened without "
                "its master key; pass --master-key-file to read or write chunks and sessions"
            )
        return self._master

    def for_tenant(self, tenant: str) -> DataKey:
        """The tenant's data key, made (and durably recorded) on first use."""
        with self._lock:
            key = self._by_tenant.get(tenant)
            if key is not None:
                return key
            master = self._need_master()
            row = _tenant_key(self._index, tenant)
            if row is None:
                new = DataKey.new(tenant)
                wrapped = master.wrap(tenant, new.key_id, new.secret)
                _add_tenant_key(self._index, new.key_id, tenant, wrapped, time.time())
                row = _tenant_key(self._index, tenant)
                assert row is not None
            key = master.unwrap(tenant, *row)
            self._by_tenant[tenant] = self._by_id[key.key_id] = key
            return key

    def by_id(self, key_id: bytes, tenant: str) -> DataKey:
        """The data key `key_id` of `tenant`; TenantKeyShredded if it was destroyed."""
        with self._lock:
            key = self._by_id.get(bytes(key_id))
            if key is None:
                row = _tenant_key_by_id(self._index, key_id)
                if row is None:
                    raise TenantKeyShredded(
                        f"the data key {bytes(key_id).hex()} of tenant {tenant!r} was destroyed "
                        "(crypto-shred): this data is unreadable; it is recomputed, and "
                        "`kvtier l3 gc` removes the files"
                    )
                key = self._need_master().unwrap(row[0], bytes(key_id), row[1])
                self._by_id[key.key_id] = key
                self._by_tenant.setdefault(key.tenant, key)
        if key.tenant != tenant:
            raise TenantKeyShredded(
                f"data key {bytes(key_id).hex()} belongs to another tenant than {tenant!r}"
            )
        return key

    def shred(self, tenant: str) -> tuple[int, int]:
        """Destroy the tenant's data key and session records; (keys, records) deleted."""
        with self._lock:
            key = self._by_tenant.pop(tenant, None)
            if key is not None:
                self._by_id.pop(key.key_id, None)
            for kid in [k for k, v in self._by_id.items() if v.tenant == tenant]:
                del self._by_id[kid]
            return shred_records(self._index, tenant)


# ---- index access (the tenant_keys table of schema v3) ----------------------------------------


def _tenant_key(index: Index, tenant: str) -> tuple[bytes, bytes] | None:
    """(key id, wrapped key) of the tenant's live data key, or None."""
    with index.locked():
        row = index.db.execute(
            "SELECT key_id, wrapped FROM tenant_keys WHERE tenant = ?", (tenant,)
        ).fetchone()
    return None if row is None else (bytes(row[0]), bytes(row[1]))


def _tenant_key_by_id(index: Index, key_id: bytes) -> tuple[str, bytes] | None:
    with index.locked():
        row = index.db.execute(
            "SELECT tenant, wrapped FROM tenant_keys WHERE key_id = ?", (bytes(key_id),)
        ).fetchone()
    return None if row is None else (str(row[0]), bytes(row[1]))


def _add_tenant_key(index: Index, key_id: bytes, tenant: str, wrapped: bytes, at: float) -> None:
    with index.locked(), index.db:
        index.db.execute(
            "INSERT INTO tenant_keys (key_id, tenant, wrapped, created) VALUES (?, ?, ?, ?) "
            "ON CONFLICT (tenant) DO NOTHING",
            (bytes(key_id), tenant, bytes(wrapped), at),
        )


def shred_records(index: Index, tenant: str) -> tuple[int, int]:
    with index.locked():
        with index.db:
            keys = index.db.execute("DELETE FROM tenant_keys WHERE tenant = ?", (tenant,))
            recs = index.db.execute("DELETE FROM sessions WHERE tenant = ?", (tenant,))
        checkpoint(index)
    return keys.rowcount, recs.rowcount


def checkpoint(index: Index) -> bool:
    """Copy the WAL into the database file and truncate it, so deleted rows survive in
    neither; True when it completed (a reader holding an old snapshot is waited for briefly)."""
    with index.locked():
        for _ in range(100):
            busy, _log, _done = index.db.execute("PRAGMA wal_checkpoint(TRUNCATE)").fetchone()
            if not busy:
                return True
            time.sleep(0.01)
    return False


def tenant_chunk_keys(index: Index, tenant: str) -> list[bytes]:
    with index.locked():
        rows = index.db.execute("SELECT key FROM chunks WHERE tenant = ?", (tenant,)).fetchall()
    return [bytes(r[0]) for r in rows]


def shredded_chunks(index: Index) -> list[ChunkRow]:
    """Sealed chunks whose data key is gone: unreadable for good, garbage for gc."""
    cols = ", ".join(f"c.{c.strip()}" for c in _ROW_COLS.split(","))
    with index.locked():
        rows = index.db.execute(
            f"SELECT {cols} FROM chunks c WHERE c.encryption != 'none' AND NOT EXISTS "
            "(SELECT 1 FROM tenant_keys k WHERE k.key_id = c.key_id)"
        ).fetchall()
    return [_row(r) for r in rows]
