"""The SQLite index of the L3 store: chunks and hibernated sessions (WAL, schema-versioned).

The .kvbin files are the truth; this index makes lookups, sizes, LRU order and session restore
fast, and `kvtier l3 fsck --rebuild` can recreate its chunk table from file headers alone.
Session ids and tenants are arbitrary user strings and live only here, never in a path.
"""

from __future__ import annotations

import sqlite3
import threading
from collections.abc import Callable, Iterable, Iterator
from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path

from kvtier.errors import StoreError
from kvtier.kvbin import KEY_SIZE, ChunkHeader
from kvtier.types import SessionState

INDEX_NAME = "index.sqlite"
SCHEMA_VERSION = 3
SESSION_STATES = frozenset(s.value for s in SessionState)


@dataclass(frozen=True)
class SessionRecord:
    """A session as persisted in L3 so that a restarted process finds it again."""

    session_id: str
    tenant: str
    fingerprint: bytes
    token_ids: bytes  # int32 little-endian array
    chunk_keys: tuple[bytes, ...]
    pinned: bool
    ttl_s: float | None
    last_active: float
    state: str
    # The data key that sealed `token_ids` (then nonce || ciphertext || tag), None: plain.
    key_id: bytes | None = None

    @property
    def token_count(self) -> int:
        """Tokens the record covers, sealed or not (a seal adds a 12-byte nonce and a tag)."""
        sealed = 0 if self.key_id is None else 12 + 16
        return max(0, len(self.token_ids) - sealed) // 4

    def validate(self) -> None:
        if not isinstance(self.session_id, str) or not isinstance(self.tenant, str):
            raise ValueError("session_id and tenant must be str")
        if len(self.fingerprint) != KEY_SIZE:
            raise ValueError(f"fingerprint must be {KEY_SIZE} bytes, got {len(self.fingerprint)}")
        if self.key_id is None and len(self.token_ids) % 4:
            raise ValueError("token_ids must be an int32 little-endian array (length % 4 == 0)")
        for key in self.chunk_keys:
            if len(key) != KEY_SIZE:
                raise ValueError(f"chunk keys must be {KEY_SIZE} bytes, got {len(key)}")
        if self.state not in SESSION_STATES:
            raise ValueError(f"state {self.state!r} unknown; use one of {sorted(SESSION_STATES)}")


@dataclass(frozen=True)
class ChunkRow:
    """One chunk as the index knows it: its header plus where the file is and when it was used."""

    header: ChunkHeader
    tier: str  # "hot" | "cold"
    size: int  # file bytes
    last_access: float


_V1 = (
    """
CREATE TABLE chunks (
    key BLOB PRIMARY KEY,
    tier TEXT NOT NULL,
    size INTEGER NOT NULL,
    last_access REAL NOT NULL,
    parent BLOB NOT NULL,
    fingerprint BLOB NOT NULL,
    tenant TEXT NOT NULL,
    tokens INTEGER NOT NULL,
    layers INTEGER NOT NULL,
    kv_heads INTEGER NOT NULL,
    head_dim INTEGER NOT NULL,
    dtype TEXT NOT NULL,
    codec TEXT NOT NULL,
    codec_params BLOB NOT NULL,
    payload_len INTEGER NOT NULL,
    created REAL NOT NULL,
    compression TEXT NOT NULL,
    checksum TEXT NOT NULL,
    payload_crc INTEGER NOT NULL
) WITHOUT ROWID
""",
    "CREATE INDEX chunks_lru ON chunks (last_access)",
    """
CREATE TABLE sessions (
    id INTEGER PRIMARY KEY,
    session_id TEXT NOT NULL,
    tenant TEXT NOT NULL,
    fingerprint BLOB NOT NULL,
    token_ids BLOB NOT NULL,
    chunk_keys BLOB NOT NULL,
    pinned INTEGER NOT NULL,
    ttl_s REAL,
    last_active REAL NOT NULL,
    state TEXT NOT NULL,
    UNIQUE (session_id, tenant)
)
""",
    """
CREATE TABLE session_chunks (
    session INTEGER NOT NULL REFERENCES sessions (id) ON DELETE CASCADE,
    key BLOB NOT NULL,
    PRIMARY KEY (session, key)
) WITHOUT ROWID
""",
    "CREATE INDEX session_chunks_key ON session_chunks (key)",
)
# v2: a key/value table for the store's settings (the cold root), and the chunk count and byte
# total kept by triggers, so that a put under a size cap does not scan the chunk table.
_V2 = (
    "CREATE TABLE meta (name TEXT PRIMARY KEY, value TEXT NOT NULL) WITHOUT ROWID",
    "CREATE TABLE totals (id INTEGER PRIMARY KEY CHECK (id = 0), "
    "chunks INTEGER NOT NULL, bytes INTEGER NOT NULL)",
    "INSERT INTO totals SELECT 0, count(*), coalesce(sum(size), 0) FROM chunks",
    "CREATE TRIGGER chunks_added AFTER INSERT ON chunks BEGIN "
    "UPDATE totals SET chunks = chunks + 1, bytes = bytes + NEW.size; END",
    "CREATE TRIGGER chunks_removed AFTER DELETE ON chunks BEGIN "
    "UPDATE totals SET chunks = chunks - 1, bytes = bytes - OLD.size; END",
    "CREATE TRIGGER chunks_resized AFTER UPDATE OF size ON chunks BEGIN "
    "UPDATE totals SET bytes = bytes - OLD.size + NEW.size; END",
)


# v3: encryption at rest. Tenant data keys wrapped by the master key (one live key per tenant;
# deleting the row is the crypto-shred), the seal of each chunk (its header's v2 fields) and
# of each session record (the key that sealed its token ids; NULL: plain).
_V3 = (
    "CREATE TABLE tenant_keys (key_id BLOB PRIMARY KEY, tenant TEXT NOT NULL UNIQUE, "
    "wrapped BLOB NOT NULL, created REAL NOT NULL) WITHOUT ROWID",
    "ALTER TABLE chunks ADD COLUMN encryption TEXT NOT NULL DEFAULT 'none'",
    "ALTER TABLE chunks ADD COLUMN key_id BLOB NOT NULL DEFAULT x''",
    "ALTER TABLE chunks ADD COLUMN nonce BLOB NOT NULL DEFAULT x''",
    "ALTER TABLE chunks ADD COLUMN tag BLOB NOT NULL DEFAULT x''",
    "ALTER TABLE sessions ADD COLUMN key_id BLOB",
)


def _steps(statements: tuple[str, ...]) -> Callable[[sqlite3.Connection], None]:
    """A migration step running `statements` one `execute` each, inside the caller's
    transaction (`executescript` would commit it first and make the step non-atomic)."""

    def step(db: sqlite3.Connection) -> None:
        for statement in statements:
            db.execute(statement)

    return step


# MIGRATIONS[i] upgrades schema version i to i + 1. Append; never edit a released step.
MIGRATIONS: tuple[Callable[[sqlite3.Connection], None], ...] = (
    _steps(_V1),
    _steps(_V2),
    _steps(_V3),
)

_HEADER_COLS = (
    "parent, fingerprint, tenant, tokens, layers, kv_heads, head_dim, dtype, codec, "
    "codec_params, payload_len, created, compression, checksum, payload_crc, "
    "encryption, key_id, nonce, tag"
)
_ROW_COLS = f"key, tier, size, last_access, {_HEADER_COLS}"
# An upsert, not INSERT OR REPLACE: REPLACE deletes the old row without firing the delete
# trigger that keeps `totals` right.
_PUT_ROW = (
    f"INSERT INTO chunks ({_ROW_COLS}) VALUES ({', '.join('?' * 23)}) ON CONFLICT (key) DO UPDATE "
    "SET " + ", ".join(f"{c.strip()} = excluded.{c.strip()}" for c in _ROW_COLS.split(",")[1:])
)


class Index:
    """Thread-safe wrapper of one SQLite connection (WAL: readers never block the writer)."""

    def __init__(self, root: Path, *, read_only: bool) -> None:
        self.path = root / INDEX_NAME
        self.read_only = read_only
        self._lock = threading.RLock()
        self._immutable = False
        self._closed = False
        if read_only:
            if not self.path.exists():
                raise StoreError(
                    f"no L3 index at {self.path}: the store was never opened for writing; "
                    "start the cache (or open it once without read_only) first"
                )
            self._conn = self._open_read_only()
        else:
            self._conn = sqlite3.connect(str(self.path), check_same_thread=False, timeout=30)
            self.path.chmod(0o600)
        # Chunk lookups of a writable index use a connection of their own: in WAL mode it
        # reads the last commit without waiting for a commit in progress (its fsync) on the
        # writing connection, so a restore's reads never queue behind puts or touches.
        self._lookup: sqlite3.Connection | None = None
        self._lookup_lock = threading.Lock()
        try:
            self._setup()
        except BaseException:
            self._conn.close()
            raise

    def _setup(self) -> None:
        self.db.execute("PRAGMA busy_timeout = 30000")
        if not self.read_only:
            self.db.execute("PRAGMA journal_mode = WAL")
            # FULL: a committed put survives power loss, not only a process crash.
            self.db.execute("PRAGMA synchronous = FULL")
            self.db.execute("PRAGMA foreign_keys = ON")
            # Deleted rows (a shredded tenant's wrapped key, its records) are overwritten with
            # zeros in the page, not left in free space (docs/security.md).
            self.db.execute("PRAGMA secure_delete = ON")
            self._migrate()
        version = self.db.execute("PRAGMA user_version").fetchone()[0]
        if version != SCHEMA_VERSION:
            raise StoreError(
                f"L3 index {self.path} has schema version {version}, this kvtier uses "
                f"{SCHEMA_VERSION}: open the store once for writing to migrate it, or upgrade"
            )
        if not self.read_only:
            self._lookup = sqlite3.connect(str(self.path), check_same_thread=False, timeout=30)
            self._lookup.execute("PRAGMA query_only = 1")

    def _open_read_only(self) -> sqlite3.Connection:
        """Open without ever writing. With no -wal file no writer is running and the database is
        fully checkpointed, so it is read as immutable (a plain read-only open would create the
        -wal and -shm files); once a writer appears the `db` property switches to shared WAL."""
        wal = self.path.with_name(self.path.name + "-wal")
        self._immutable = not wal.exists()
        mode = "mode=ro&immutable=1" if self._immutable else "mode=ro"
        uri = f"{self.path.resolve().as_uri()}?{mode}"
        return sqlite3.connect(uri, uri=True, check_same_thread=False, timeout=30)

    @property
    def db(self) -> sqlite3.Connection:
        if self._closed:
            raise StoreError("L3 store is closed; open a new L3Store")
        if self._immutable and self.path.with_name(self.path.name + "-wal").exists():
            with self._lock:
                if self._immutable:
                    self._conn.close()
                    self._conn = self._open_read_only()
        return self._conn

    def _migrate(self) -> None:
        with self._lock:
            version = self.db.execute("PRAGMA user_version").fetchone()[0]
            if version > SCHEMA_VERSION:
                raise StoreError(
                    f"L3 index {self.path} has schema version {version}, newer than this "
                    f"kvtier's {SCHEMA_VERSION}: upgrade kvtier, or run `kvtier l3 fsck "
                    "--rebuild` with this version to rebuild the chunk index from the files"
                )
            for step in range(version, SCHEMA_VERSION):
                self.db.execute("BEGIN IMMEDIATE")
                try:
                    MIGRATIONS[step](self.db)
                    self.db.execute(f"PRAGMA user_version = {step + 1}")
                    self.db.commit()
                except BaseException:
                    self.db.rollback()
                    raise

    def locked(self) -> AbstractContextManager[bool]:
        """The index's lock (re-entrant) around the writing connection, for a statement run on
        `db` outside this class (the tenant keys of l3_keys): `with index.locked(): ...`."""
        return self._lock

    def close(self) -> None:
        with self._lock, self._lookup_lock:
            self._closed = True
            self._conn.close()
            if self._lookup is not None:
                self._lookup.close()

    # ---- chunks ------------------------------------------------------------------------------

    def put_chunks(self, rows: Iterable[ChunkRow]) -> None:
        """Insert or replace rows in one transaction (one WAL fsync for a batch)."""
        values = [_row_values(row) for row in rows]
        with self._lock, self.db:
            self.db.executemany(_PUT_ROW, values)

    def get_chunk(self, key: bytes) -> ChunkRow | None:
        sql = f"SELECT {_ROW_COLS} FROM chunks WHERE key = ?"
        if self._lookup is None:
            with self._lock:
                row = self.db.execute(sql, (bytes(key),)).fetchone()
        else:
            with self._lookup_lock:
                if self._closed:
                    raise StoreError("L3 store is closed; open a new L3Store")
                row = self._lookup.execute(sql, (bytes(key),)).fetchone()
        return _row(row) if row else None

    def delete_chunks(self, keys: Iterable[bytes]) -> None:
        with self._lock, self.db:
            self.db.executemany("DELETE FROM chunks WHERE key = ?", [(bytes(k),) for k in keys])

    def set_tier(self, key: bytes, tier: str) -> None:
        with self._lock, self.db:
            self.db.execute("UPDATE chunks SET tier = ? WHERE key = ?", (tier, bytes(key)))

    def touch(self, stamps: dict[bytes, float]) -> None:
        """Record last-access times (batched by the store: reads must not cost a commit each)."""
        with self._lock, self.db:
            self.db.executemany(
                "UPDATE chunks SET last_access = max(last_access, ?) WHERE key = ?",
                [(t, k) for k, t in stamps.items()],
            )

    def iter_chunks(self, *, order_lru: bool = False) -> Iterator[ChunkRow]:
        order = " ORDER BY last_access" if order_lru else ""
        with self._lock:
            rows = self.db.execute(f"SELECT {_ROW_COLS} FROM chunks{order}").fetchall()
        for row in rows:
            yield _row(row)

    def any_cold_key(self) -> bytes | None:
        with self._lock:
            row = self.db.execute("SELECT key FROM chunks WHERE tier = 'cold' LIMIT 1").fetchone()
        return None if row is None else bytes(row[0])

    def totals(self) -> tuple[int, int]:
        """(chunks, bytes) currently indexed (kept by triggers: no scan)."""
        with self._lock:
            n, size = self.db.execute("SELECT chunks, bytes FROM totals").fetchone()
        return int(n), int(size)

    def recount(self) -> bool:
        """Recompute the totals from the chunk table; True if they were wrong (fsck)."""
        with self._lock, self.db:
            n, size = self.db.execute(
                "SELECT count(*), coalesce(sum(size), 0) FROM chunks"
            ).fetchone()
            cur = self.db.execute(
                "UPDATE totals SET chunks = ?, bytes = ? WHERE chunks != ? OR bytes != ?",
                (n, size, n, size),
            )
        return cur.rowcount > 0

    def referenced(self, key: bytes) -> bool:
        with self._lock:
            row = self.db.execute(
                "SELECT 1 FROM session_chunks WHERE key = ? LIMIT 1", (bytes(key),)
            ).fetchone()
        return row is not None

    def unreferenced_lru(
        self, older_than: float | None = None, *, batch: int = 64
    ) -> Iterator[ChunkRow]:
        """Chunks no session references, least recently used first, fetched `batch` at a time
        (a caller that stops early never loads the rest of the table)."""
        cols = ", ".join(f"c.{c.strip()}" for c in _ROW_COLS.split(","))
        after: tuple[float, bytes] | None = None
        while True:
            cond, args = "", list[object]()
            if older_than is not None:
                cond, args = "AND c.last_access < ? ", [older_than]
            if after is not None:
                cond += "AND (c.last_access, c.key) > (?, ?) "
                args += list(after)
            with self._lock:
                rows = self.db.execute(
                    f"SELECT {cols} FROM chunks c WHERE NOT EXISTS "
                    f"(SELECT 1 FROM session_chunks s WHERE s.key = c.key) {cond}"
                    "ORDER BY c.last_access, c.key LIMIT ?",
                    (*args, batch),
                ).fetchall()
            for r in rows:
                yield _row(r)
            if len(rows) < batch:
                return
            after = (rows[-1][3], rows[-1][0])

    # ---- settings ----------------------------------------------------------------------------

    def get_meta(self, name: str) -> str | None:
        with self._lock:
            row = self.db.execute("SELECT value FROM meta WHERE name = ?", (name,)).fetchone()
        return None if row is None else str(row[0])

    def set_meta(self, name: str, value: str) -> None:
        with self._lock, self.db:
            self.db.execute(
                "INSERT INTO meta (name, value) VALUES (?, ?) "
                "ON CONFLICT (name) DO UPDATE SET value = excluded.value",
                (name, value),
            )

    def clear_chunks(self) -> None:
        with self._lock, self.db:
            self.db.execute("DELETE FROM chunks")

    # ---- sessions ----------------------------------------------------------------------------

    def save_session(self, rec: SessionRecord) -> None:
        rec.validate()
        with self._lock, self.db:
            self.db.execute(
                "DELETE FROM sessions WHERE session_id = ? AND tenant = ?",
                (rec.session_id, rec.tenant),
            )
            cur = self.db.execute(
                "INSERT INTO sessions (session_id, tenant, fingerprint, token_ids, chunk_keys, "
                "pinned, ttl_s, last_active, state, key_id) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                (
                    rec.session_id,
                    rec.tenant,
                    bytes(rec.fingerprint),
                    bytes(rec.token_ids),
                    b"".join(bytes(k) for k in rec.chunk_keys),
                    int(rec.pinned),
                    rec.ttl_s,
                    rec.last_active,
                    rec.state,
                    None if rec.key_id is None else bytes(rec.key_id),
                ),
            )
            self.db.executemany(
                "INSERT OR IGNORE INTO session_chunks (session, key) VALUES (?, ?)",
                [(cur.lastrowid, bytes(k)) for k in rec.chunk_keys],
            )

    def load_session(self, session_id: str, tenant: str) -> SessionRecord | None:
        with self._lock:
            row = self.db.execute(
                f"SELECT {_SESSION_COLS} FROM sessions WHERE session_id = ? AND tenant = ?",
                (session_id, tenant),
            ).fetchone()
        return _session(row) if row else None

    def session_tenants(self, session_id: str) -> list[str]:
        """The tenants having a session of this id."""
        with self._lock:
            rows = self.db.execute(
                "SELECT tenant FROM sessions WHERE session_id = ? ORDER BY tenant", (session_id,)
            ).fetchall()
        return [str(r[0]) for r in rows]

    def session_keys(
        self, fingerprint: bytes, after: int = 0, limit: int = 256
    ) -> list[tuple[int, str, str]]:
        """(row id, session_id, tenant) of up to `limit` session records of `fingerprint` past
        row id `after`, in row order: pages through the records without loading their tokens."""
        with self._lock:
            rows = self.db.execute(
                "SELECT id, session_id, tenant FROM sessions WHERE id > ? AND fingerprint = ? "
                "ORDER BY id LIMIT ?",
                (after, bytes(fingerprint), limit),
            ).fetchall()
        return [(int(i), str(s), str(t)) for i, s, t in rows]

    def list_sessions(self) -> list[SessionRecord]:
        with self._lock:
            rows = self.db.execute(f"SELECT {_SESSION_COLS} FROM sessions ORDER BY id").fetchall()
        return [_session(r) for r in rows]

    def delete_session(self, session_id: str, tenant: str) -> bool:
        with self._lock, self.db:
            cur = self.db.execute(
                "DELETE FROM sessions WHERE session_id = ? AND tenant = ?", (session_id, tenant)
            )
        return cur.rowcount > 0

    def expired_sessions(self, now: float) -> list[tuple[str, str]]:
        """(session_id, tenant) of unpinned sessions whose TTL has run out."""
        with self._lock:
            rows = self.db.execute(
                "SELECT session_id, tenant FROM sessions WHERE pinned = 0 AND ttl_s IS NOT NULL "
                "AND last_active + ttl_s < ?",
                (now,),
            ).fetchall()
        return [(str(a), str(b)) for a, b in rows]

    def dangling_references(self) -> list[tuple[str, str, bytes]]:
        """(session_id, tenant, key) for session chunks that are not in the chunk table."""
        with self._lock:
            rows = self.db.execute(
                "SELECT s.session_id, s.tenant, sc.key FROM session_chunks sc "
                "JOIN sessions s ON s.id = sc.session "
                "WHERE NOT EXISTS (SELECT 1 FROM chunks c WHERE c.key = sc.key)"
            ).fetchall()
        return [(str(a), str(b), bytes(k)) for a, b, k in rows]

    def session_count(self) -> int:
        with self._lock:
            return int(self.db.execute("SELECT count(*) FROM sessions").fetchone()[0])


_SESSION_COLS = (
    "session_id, tenant, fingerprint, token_ids, chunk_keys, pinned, ttl_s, last_active, state, "
    "key_id"
)


def _session(row: tuple) -> SessionRecord:
    keys = bytes(row[4])
    return SessionRecord(
        session_id=row[0],
        tenant=row[1],
        fingerprint=bytes(row[2]),
        token_ids=bytes(row[3]),
        chunk_keys=tuple(keys[i : i + KEY_SIZE] for i in range(0, len(keys), KEY_SIZE)),
        pinned=bool(row[5]),
        ttl_s=row[6],
        last_active=row[7],
        state=row[8],
        key_id=None if row[9] is None else bytes(row[9]),
    )


def _row_values(row: ChunkRow) -> tuple:
    h = row.header
    return (
        bytes(h.key),
        row.tier,
        row.size,
        row.last_access,
        bytes(h.parent),
        bytes(h.fingerprint),
        h.tenant,
        h.tokens,
        h.layers,
        h.kv_heads,
        h.head_dim,
        h.dtype,
        h.codec,
        bytes(h.codec_params),
        h.payload_len,
        h.created,
        h.compression,
        h.checksum,
        h.payload_crc,
        h.encryption,
        bytes(h.key_id),
        bytes(h.nonce),
        bytes(h.tag),
    )


def _row(r: tuple) -> ChunkRow:
    header = ChunkHeader(
        key=bytes(r[0]),
        parent=bytes(r[4]),
        fingerprint=bytes(r[5]),
        tenant=r[6],
        tokens=r[7],
        layers=r[8],
        kv_heads=r[9],
        head_dim=r[10],
        dtype=r[11],
        codec=r[12],
        codec_params=bytes(r[13]),
        payload_len=r[14],
        created=r[15],
        compression=r[16],
        checksum=r[17],
        payload_crc=r[18],
        encryption=r[19],
        key_id=bytes(r[20]),
        nonce=bytes(r[21]),
        tag=bytes(r[22]),
    )
    return ChunkRow(header=header, tier=r[1], size=r[2], last_access=r[3])
