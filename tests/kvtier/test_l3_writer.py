"""The L3 writer process's lifetime: a failed start leaves no child, a write never waits forever.

Real child processes, real shared L2 slabs and real temp files; the failures are a real
SIGKILL or SIGSTOP of the child, and a send that fails as a broken pipe would.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Iterator
from dataclasses import replace
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import psutil
import pytest

from kvtier.codecs import make_codec
from kvtier.errors import ConfigError, StoreIOError
from kvtier.geometry import KVGeometry
from kvtier.kvbin import ChunkHeader
from kvtier.tiers.l2 import HostArena
from kvtier.tiers.l3.writer import WriterProcess

pytestmark = pytest.mark.skipif(
    not hasattr(os, "memfd_create"), reason="the writer process maps memfd slabs"
)

G = KVGeometry(2, 2, 8, 8, "bfloat16", "gqa")
CHUNK = 16


def _children() -> set[int]:
    return {c.pid for c in psutil.Process().children(recursive=True)}


def _fds() -> set[str]:
    return set(os.listdir("/proc/self/fd"))


@pytest.fixture
def arena() -> Iterator[HostArena]:
    c = make_codec("native", G)
    with HostArena(c.payload_bytes(CHUNK), 4 * c.payload_bytes(CHUNK), pin=False, shared=True) as a:
        yield a


def _header(key: bytes) -> ChunkHeader:
    header = make_codec("native", G).header(key, CHUNK, fingerprint=b"F" * 16, tenant="t")
    return replace(header, checksum="crc32")  # as L3Store.put fills it in


def _write_in_thread(
    proc: WriterProcess, arena: HostArena, tmp: Path, key: bytes
) -> tuple[threading.Thread, dict[str, Any]]:
    """Start `proc.write` of slot 0 on a daemon thread (which the old code never ended)."""
    header = _header(key)
    slab, offset = arena.locate(0)
    out: dict[str, Any] = {}

    def run() -> None:
        t0 = time.monotonic()
        try:
            out["result"] = proc.write(
                slab, offset, header.payload_len, header, str(tmp), False, False
            )
        except BaseException as exc:
            out["error"] = exc
        out["seconds"] = time.monotonic() - t0

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, out


def test_a_write_answers(arena: HostArena, tmp_path: Path) -> None:
    proc = WriterProcess(arena.slabs(), threads=1)
    try:
        thread, out = _write_in_thread(proc, arena, tmp_path / "a.tmp", b"a" * 16)
        thread.join(30)
        assert "result" in out, out
        assert (tmp_path / "a.tmp").stat().st_size > 0
    finally:
        proc.close()


def test_a_failed_init_message_leaves_no_child_and_no_pipe(
    arena: HostArena, monkeypatch: pytest.MonkeyPatch
) -> None:
    before, fds = _children(), _fds()

    def broken(self: Connection, obj: object) -> None:
        raise BrokenPipeError(32, "Broken pipe")

    monkeypatch.setattr(Connection, "send", broken)
    with pytest.raises(BrokenPipeError):
        WriterProcess(arena.slabs(), threads=1)
    assert _children() == before  # killed and reaped: not running, not a zombie
    assert _fds() == fds


def test_a_timeout_must_be_positive(arena: HostArena) -> None:
    with pytest.raises(ConfigError, match="timeout"):
        WriterProcess(arena.slabs(), timeout=0)


def test_a_dead_child_fails_the_write_promptly_even_with_its_pipes_held_open(
    arena: HostArena, tmp_path: Path
) -> None:
    """The child is killed while another process (here: this one) still holds its ends of the
    pipes, so no EOF ever comes; its exit alone must fail the write, well before `timeout`."""
    proc = WriterProcess(arena.slabs(), threads=1, timeout=60)
    child = psutil.Process(proc.pid)
    # Popen returns once the exec passed its point of no return, a moment before the kernel
    # sets the new program's arguments: until then /proc/PID/cmdline reads empty
    deadline = time.monotonic() + 10
    while "--rx" not in (args := child.cmdline()):
        assert time.monotonic() < deadline, args
        time.sleep(0.01)
    rx, tx = args[args.index("--rx") + 1], args[args.index("--tx") + 1]
    held = [
        os.open(f"/proc/{proc.pid}/fd/{rx}", os.O_RDONLY),
        os.open(f"/proc/{proc.pid}/fd/{tx}", os.O_WRONLY),
    ]
    try:
        os.kill(proc.pid, signal.SIGKILL)
        deadline = time.monotonic() + 10
        while child.status() != psutil.STATUS_ZOMBIE:  # dead; left for the write to notice
            assert time.monotonic() < deadline
            time.sleep(0.01)
        thread, out = _write_in_thread(proc, arena, tmp_path / "b.tmp", b"b" * 16)
        thread.join(10)
        assert not thread.is_alive(), "the write waited for an answer from a dead child"
        assert isinstance(out["error"], StoreIOError)
        assert "writer process is gone (exit status -9)" in str(out["error"])
        assert out["seconds"] < 5
        assert not (tmp_path / "b.tmp").exists()
        with pytest.raises(StoreIOError, match="gone"):  # later writes fail at once
            header = _header(b"c" * 16)
            proc.write(
                *arena.locate(0), header.payload_len, header, str(tmp_path / "c"), False, False
            )
    finally:
        for fd in held:
            os.close(fd)
        proc.close()
    assert proc.pid not in _children()


def test_a_child_that_stops_answering_is_killed_after_the_timeout(
    arena: HostArena, tmp_path: Path
) -> None:
    proc = WriterProcess(arena.slabs(), threads=1, timeout=1.0)
    try:
        os.kill(proc.pid, signal.SIGSTOP)  # alive, pipes open, never answers
        thread, out = _write_in_thread(proc, arena, tmp_path / "d.tmp", b"d" * 16)
        thread.join(15)
        assert not thread.is_alive(), "the write waited forever for a stopped child"
        assert isinstance(out["error"], StoreIOError)
        assert "no answer to a write within 1 s" in str(out["error"])
        assert 1.0 <= out["seconds"] < 10
        assert proc.pid not in _children()  # killed and reaped
        assert not (tmp_path / "d.tmp").exists()
    finally:
        if proc.pid in _children():
            os.kill(proc.pid, signal.SIGKILL)
        proc.close()
