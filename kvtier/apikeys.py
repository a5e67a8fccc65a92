"""API keys: who a request comes from (its tenant) and whether it may run admin operations.

A key is `kvt_<id>_<secret>`: an 8-hex-digit id that names the key in listings and revocations,
and 256 random bits from `secrets`. The keys file stores, per key, its id, tenant, admin flag,
gateway flag, creation time and the SHA-256 of the whole key, never the key itself: whoever reads
the file cannot present any key in it. A fast hash suffices because the key is random (nothing
to guess from a dictionary); a slow one (scrypt) would only slow every request. A file written
before gateway keys (no "gateway" field) reads as it did: none of its keys is a gateway's.

The file is JSON, written atomically (a private temporary file, fsync, rename, fsync of the
directory) with mode 0600. A file that group or other users can read or write is refused: the
hashes in it are not secrets, but whoever can write it can add a key.

Pure standard library (no torch, no fastapi): `kvtier keys` and the server both use it.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import hmac
import json
import os
import re
import secrets
import stat
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvtier.errors import KeysFileError

FORMAT = "kvtier-api-keys"
VERSION = 1
PREFIX = "kvt_"
_ID_HEX = 8  # hex digits of a key's id
_SECRET_BYTES = 32  # 256 bits
# The tenant alphabet of the server's X-Tenant header ('#' stays reserved for kvtier's own).
_TENANT = re.compile(r"^[A-Za-z0-9._:@/+=-]{1,64}$")
_KEY = re.compile(r"^kvt_([0-9a-f]{8})_[A-Za-z0-9_-]{43}$")
_HASH = re.compile(r"^[0-9a-f]{64}$")


@dataclass(frozen=True)
class Principal:
    """Who a request authenticated as."""

    tenant: str
    admin: bool
    key_id: str
    # A gateway's key: with --trust-tenant-header its requests may name any tenant in X-Tenant
    # (the gateway in front authenticated the client). No other key may name another tenant.
    gateway: bool = False


@dataclass(frozen=True)
class KeyRecord:
    """One key as the file stores it: everything but the key."""

    id: str
    tenant: str
    admin: bool
    sha256: str
    created: float  # unix seconds
    gateway: bool = False  # absent from files written before gateway keys: not a gateway's

    def principal(self) -> Principal:
        return Principal(self.tenant, self.admin, self.id, self.gateway)

    def as_json(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "tenant": self.tenant,
            "admin": self.admin,
            "gateway": self.gateway,
            "sha256": self.sha256,
            "created": self.created,
        }


def _digest(key: str) -> str:
    return hashlib.sha256(key.encode("utf-8")).hexdigest()


# Compared against when a presented key names no known id, so that an unknown id costs the
# same hash and comparison as a wrong secret.
_DUMMY = _digest(PREFIX + "0" * _ID_HEX + "_" + "0" * 43)


def check_tenant(tenant: str) -> str:
    if not _TENANT.match(tenant):
        raise KeysFileError(
            f"tenant {tenant[:80]!r}: use 1 to 64 characters of letters, digits and . _ : @ / + = -"
        )
    return tenant


class KeyRing:
    """The keys of one file, looked up by the key a request presents."""

    def __init__(self, records: list[KeyRecord]) -> None:
        self.records = list(records)
        self._by_id = {r.id: r for r in records}

    def __len__(self) -> int:
        return len(self.records)

    def lookup(self, key: str) -> Principal | None:
        """The principal of a valid key; None for anything else (unknown, revoked, malformed)."""
        m = _KEY.match(key)
        record = self._by_id.get(m.group(1)) if m else None
        digest = _digest(key) if m else _DUMMY
        want = record.sha256 if record is not None else _DUMMY
        ok = hmac.compare_digest(digest, want)
        return record.principal() if ok and record is not None else None

    def tenants(self) -> set[str]:
        return {r.tenant for r in self.records}


# ---- the file ---------------------------------------------------------------------------------


def check_private(path: Path, st: os.stat_result) -> None:
    """Refuse a keys file others may read or write, or that is not a regular file."""
    if not stat.S_ISREG(st.st_mode):
        raise KeysFileError(f"API keys file {path} is not a regular file")
    if st.st_mode & 0o077:
        raise KeysFileError(
            f"API keys file {path} has mode {stat.S_IMODE(st.st_mode):04o}: group or other "
            f"users can read or write it; run `chmod 600 {path}` (kvtier keys writes it so)"
        )


def load(path: str | os.PathLike[str]) -> KeyRing:
    """Read and check a keys file; every problem is a KeysFileError that says what to do."""
    path = Path(path)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except FileNotFoundError:
        raise KeysFileError(
            f"API keys file {path} does not exist; create it with "
            f"`kvtier keys add TENANT --file {path}`"
        ) from None
    except OSError as exc:
        raise KeysFileError(f"API keys file {path} cannot be opened: {exc.strerror}") from None
    with os.fdopen(fd, "rb") as f:
        check_private(path, os.fstat(f.fileno()))
        raw = f.read()
    return parse(raw, path)


def parse(raw: bytes, path: Path) -> KeyRing:
    def bad(why: str) -> KeysFileError:
        return KeysFileError(
            f"API keys file {path} is not a kvtier keys file ({why}); restore it from a backup "
            "or write a new one with `kvtier keys add`"
        )

    try:
        data = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise bad(f"not JSON: {exc}") from None
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise bad(f'no "format": "{FORMAT}"')
    if data.get("version") != VERSION:
        raise bad(f"version {data.get('version')!r}; this kvtier reads version {VERSION}")
    keys = data.get("keys")
    if not isinstance(keys, list):
        raise bad('"keys" is not a list')
    records: list[KeyRecord] = []
    seen: set[str] = set()
    for i, item in enumerate(keys):
        try:
            rec = KeyRecord(
                id=item["id"],
                tenant=item["tenant"],
                admin=item["admin"],
                sha256=item["sha256"],
                created=float(item["created"]),
                gateway=item.get("gateway", False),
            )
        except (TypeError, KeyError, ValueError) as exc:
            raise bad(f"key #{i} lacks or mangles a field: {exc}") from None
        if not (isinstance(rec.id, str) and re.fullmatch(r"[0-9a-f]{8}", rec.id)):
            raise bad(f"key #{i} has id {rec.id!r}")
        if not (isinstance(rec.sha256, str) and _HASH.match(rec.sha256)):
            raise bad(f"key {rec.id} has no valid sha256")
        if not isinstance(rec.admin, bool) or not isinstance(rec.tenant, str):
            raise bad(f"key {rec.id} has a non-boolean admin or a non-string tenant")
        if not isinstance(rec.gateway, bool):
            raise bad(f"key {rec.id} has a non-boolean gateway")
        try:
            check_tenant(rec.tenant)
        except KeysFileError as exc:
            raise bad(f"key {rec.id}: {exc}") from None
        if rec.id in seen:
            raise bad(f"key id {rec.id} appears twice")
        seen.add(rec.id)
        records.append(rec)
    return KeyRing(records)


def dump(ring: KeyRing) -> bytes:
    data = {"format": FORMAT, "version": VERSION, "keys": [r.as_json() for r in ring.records]}
    return (json.dumps(data, indent=2) + "\n").encode("utf-8")


def save(path: str | os.PathLike[str], ring: KeyRing) -> None:
    """Replace the file atomically: a reader sees the old keys or the new ones, never a mix."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{secrets.token_hex(4)}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
    try:
        with os.fdopen(fd, "wb") as f:
            os.fchmod(f.fileno(), 0o600)  # whatever the umask
            f.write(dump(ring))
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    dfd = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(dfd)
    finally:
        os.close(dfd)


@contextlib.contextmanager
def editing(path: str | os.PathLike[str]) -> Iterator[KeyRing]:
    """Load (or start) the file, let the caller change the ring, save it; one editor at a time
    (an advisory lock on `<file>.lock` beside it)."""
    path = Path(path)
    if not path.parent.is_dir():
        raise KeysFileError(f"directory {path.parent} does not exist; create it first")
    lock = os.open(
        path.with_name(path.name + ".lock"), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600
    )
    try:
        fcntl.flock(lock, fcntl.LOCK_EX)
        ring = load(path) if path.exists() else KeyRing([])
        yield ring
        save(path, ring)
    finally:
        os.close(lock)


def new_key() -> tuple[str, str]:
    """(key id, key): the key is shown once and never stored."""
    key_id = secrets.token_hex(_ID_HEX // 2)
    return key_id, f"{PREFIX}{key_id}_{secrets.token_urlsafe(_SECRET_BYTES)}"


def add(
    path: str | os.PathLike[str], tenant: str, admin: bool = False, gateway: bool = False
) -> tuple[KeyRecord, str]:
    """Create a key for `tenant` (a gateway's with `gateway`: see Principal); returns its record
    and the key (to print once)."""
    check_tenant(tenant)
    with editing(path) as ring:
        taken = {r.id for r in ring.records}
        key_id, key = new_key()
        while key_id in taken:  # 1 in 4 billion per key; never two keys with one id
            key_id, key = new_key()
        rec = KeyRecord(key_id, tenant, admin, _digest(key), round(time.time(), 3), gateway)
        ring.records.append(rec)
    return rec, key


def revoke(
    path: str | os.PathLike[str], key_id: str | None = None, tenant: str | None = None
) -> list[KeyRecord]:
    """Remove the key `key_id`, or every key of `tenant`; returns what was removed."""
    if (key_id is None) == (tenant is None):
        raise KeysFileError("name one key id or one tenant to revoke")
    if not Path(path).exists():
        raise KeysFileError(f"API keys file {path} does not exist; nothing to revoke")
    with editing(path) as ring:
        gone = [r for r in ring.records if r.id == key_id or r.tenant == tenant]
        ring.records[:] = [r for r in ring.records if r not in gone]
    return gone
