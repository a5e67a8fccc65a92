"""L3, the SSD tier: `.kvbin` chunk files under a root, a SQLite index, session records.

`store` holds the store itself (`L3Store`); the other modules are its parts: `layout` (where
files go), `write`/`writer`/`commit` (durable writes, the writer process, batched fsyncs),
`read` (verified reads), `index` (the SQLite index and its migrations), `keys` (sealing),
`cap` (the size cap), `maint` (gc, fsck, migrate), `access`, `pools`, `stats`, `root` (the
root's lock and cold root) and `io` (the page-cache and I/O bindings)."""

from kvtier.tiers.l3.store import (
    TIERS,
    L3Store,
    SessionRecord,
    ShredReport,
    StoreInUse,
    write_chunk_file,
)

__all__ = [
    "TIERS",
    "L3Store",
    "SessionRecord",
    "ShredReport",
    "StoreInUse",
    "write_chunk_file",
]
