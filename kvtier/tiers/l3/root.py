"""The L3 store's directories: permission checks, the writer lock and the cold root.

One process at a time opens a store for writing; it holds an exclusive `flock` on
`<root>/.lock` and writes its PID there, so that a second one can say who holds the store.
The cold root (where `kvtier l3 migrate` moves idle chunks) is part of the store's
configuration and is recorded in the index: reads and maintenance then look in the same place,
and opening with another cold root is refused unless it is adopted explicitly.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import stat
from pathlib import Path

from kvtier.errors import StoreError, UnsafeRootError
from kvtier.tiers.l3.index import Index

COLD_ROOT_KEY = "cold_root"  # meta value: "" = <root>/cold, else an absolute path
_READ_ONLY_COMMANDS = "`kvtier l3 stat`, `kvtier l3 ls` and `kvtier l3 fsck --check`"


class StoreInUse(StoreError):
    """Another process (or another store object in this one) has the L3 root open for writing."""

    def __init__(self, message: str, pid: int | None) -> None:
        super().__init__(message)
        self.pid = pid


def check_safe(path: Path, *, writable: bool) -> None:
    """Refuse a directory that another user owns or that others may write to."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        raise StoreError(
            f"L3 root {path} does not exist; create it or open the store writable"
        ) from None
    if not stat.S_ISDIR(st.st_mode):
        raise UnsafeRootError(f"L3 root {path} is not a directory; point the store at a directory")
    euid = os.geteuid()
    if st.st_uid != euid and (writable or euid != 0):
        raise UnsafeRootError(
            f"L3 directory {path} is owned by uid {st.st_uid}, not by this user (uid {euid}); "
            f"run as its owner or `chown -R {euid} {path}`"
        )
    if st.st_mode & (stat.S_IWOTH | stat.S_IWGRP):
        who = "world" if st.st_mode & stat.S_IWOTH else "group"
        raise UnsafeRootError(
            f"L3 directory {path} is {who}-writable (mode {stat.S_IMODE(st.st_mode):o}): other "
            f"users could plant or delete chunks; run `chmod 700 {path}`"
        )


def take_lock(root: Path) -> int:
    """Lock `root` for writing and record this PID in its lock file; returns the lock's fd."""
    fd = os.open(root / ".lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        pid = _holder(fd)
        os.close(fd)
        raise StoreInUse(_in_use(root, pid), pid) from None
    except BaseException:
        os.close(fd)
        raise
    with contextlib.suppress(OSError):  # the PID only improves a message; never fail on it
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    return fd


def check_free(root: Path) -> None:
    """Raise `StoreInUse` when another process holds `root`'s writer lock: a check a server
    makes before it starts, so a held store fails at once, not after the model loads. It takes
    nothing: opening the store takes the lock for real (and fails the same way in a race)."""
    try:
        fd = os.open(root / ".lock", os.O_RDONLY | os.O_CLOEXEC)
    except OSError:  # no store there yet, or unreadable: opening it will say why
        return
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        pid = _holder(fd)
        raise StoreInUse(_in_use(root, pid), pid) from None
    finally:
        os.close(fd)  # closing drops the shared lock too


def _holder(fd: int) -> int | None:
    try:
        text = os.pread(fd, 32, 0).decode("ascii", "replace").strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None


def _in_use(root: Path, pid: int | None) -> str:
    if pid == os.getpid():
        return (
            f"L3 store {root} is already open for writing in this process (pid {pid}); "
            "close that store first"
        )
    who = f"process {pid}" if pid else "another process"
    return (
        f"L3 store {root} is in use by {who} (a running `kvtier serve` or `kvtier l3` "
        "command), and one process at a time may write a store; stop that one first, or give "
        f"this one another --l3-root. Read-only commands work meanwhile: {_READ_ONLY_COMMANDS}"
    )


def resolve_cold_root(
    index: Index, root: Path, given: str | os.PathLike[str] | None, *, writable: bool, adopt: bool
) -> Path:
    """The cold root to use: the recorded one when none is given; the given one when none is
    recorded yet (recording it) or when `adopt`; otherwise a mismatch is refused."""
    default = root / "cold"
    want = None if given is None else Path(given).expanduser().absolute()
    recorded = index.get_meta(COLD_ROOT_KEY)
    have = None if recorded is None else (Path(recorded) if recorded else default)
    if have is None and want is not None and not _same(want, default):
        have = _unrecorded_cold_root(index, default, want)
    if want is None:
        return have or default
    if have is None or adopt or _same(want, have):
        if writable and (have is None or not _same(want, have)):
            index.set_meta(COLD_ROOT_KEY, "" if _same(want, default) else str(want))
        return want
    raise StoreError(
        f"L3 store {root} keeps its cold chunks in {have}, but cold root {want} was "
        f"configured: set the cold root to {have} (--l3-cold-root / KVTIER_L3_COLD_ROOT, or "
        f"--l3-cold-root for `kvtier l3`), or leave it unset; if you moved the cold files to "
        f"{want}, record that with `kvtier l3 fsck --l3-root {root} --l3-cold-root {want} "
        "--adopt-cold-root`"
    )


def _unrecorded_cold_root(index: Index, default: Path, want: Path) -> Path | None:
    """For a store that recorded no cold root (made before it was recorded): <root>/cold if a
    cold chunk is found there and not under `want`, so that naming `want` does not hide the
    chunks already cold; else None (nothing to lose: `want` is recorded)."""
    key = index.any_cold_key()
    if key is None:
        return None
    name = Path(key.hex()[:2]) / f"{key.hex()}.kvbin"
    if (default / name).exists() and not (want / name).exists():
        return default
    return None


def _same(a: Path, b: Path) -> bool:
    return os.path.realpath(a) == os.path.realpath(b)
