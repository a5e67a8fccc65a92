"""Page-cache residency of real files: cachestat and mincore agree, O_DIRECT leaves no trace."""

from __future__ import annotations

import mmap
import os
from pathlib import Path

import pytest

from ops.collectors import pagecache

SIZE = 64 * mmap.PAGESIZE  # 64 pages
METHODS = ["mincore"] + (["cachestat"] if pagecache.HAVE_CACHESTAT else [])


def _chunk(path: Path, size: int = SIZE) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "wb") as f:
        f.write(os.urandom(size))
        f.flush()
        os.fsync(f.fileno())
    return path


def _drop(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def _cached(path: Path, method: pagecache.Method) -> int:
    found = pagecache.residency(str(path), method)
    assert found is not None
    result, used = found
    assert used == method and result.pages == 64
    return result.cached


@pytest.mark.parametrize("method", METHODS)
def test_residency_follows_reads_and_drops(tmp_path: Path, method: pagecache.Method) -> None:
    path = _chunk(tmp_path / "a.kvbin")
    _drop(path)  # clean after fsync, so DONTNEED evicts every page
    assert _cached(path, method) == 0
    with open(path, "rb") as f:
        f.read(SIZE // 2)  # first 32 pages (readahead may bring more)
    assert _cached(path, method) >= 32
    path.read_bytes()
    assert _cached(path, method) == 64


def test_o_direct_reads_bypass_the_page_cache(tmp_path: Path) -> None:
    path = _chunk(tmp_path / "b.kvbin")
    _drop(path)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    except OSError:
        pytest.skip("this filesystem refuses O_DIRECT")
    try:
        buf = mmap.mmap(-1, SIZE)  # page-aligned buffer, as O_DIRECT requires
        assert os.readv(fd, [buf]) == SIZE
    finally:
        os.close(fd)
    assert _cached(path, "mincore") == 0


@pytest.mark.skipif(not pagecache.HAVE_CACHESTAT, reason="cachestat needs Linux >= 6.5")
def test_cachestat_counts_dirty_pages(tmp_path: Path) -> None:
    path = tmp_path / "c.kvbin"
    with open(path, "wb") as f:
        f.write(b"\1" * SIZE)  # not synced: dirty in the page cache
        f.flush()
        found = pagecache.residency(str(path), "cachestat")
        assert found is not None
        assert found[0].dirty + found[0].writeback == 64 and found[0].cached == 64


def test_store_scan_is_bounded(tmp_path: Path) -> None:
    for i in range(6):
        _chunk(tmp_path / "hot" / f"{i:02x}" / f"{i:02x}aa.kvbin")
    _chunk(tmp_path / "cold" / "ff" / "ffaa.kvbin")
    (tmp_path / "hot" / "00" / "index.tmp").write_bytes(b"x")  # not a chunk
    for i in range(6):
        _drop(tmp_path / "hot" / f"{i:02x}" / f"{i:02x}aa.kvbin")
    (tmp_path / "hot" / "00" / "00aa.kvbin").read_bytes()  # one of six resident
    reading = pagecache.read(str(tmp_path), max_files=6)
    assert reading.files == 6 and reading.sampled  # the seventh (cold) file is not looked at
    assert reading.bytes == 6 * SIZE
    assert reading.residency.pages == 6 * 64 and reading.residency.cached == 64
    assert reading.resident_ratio == 64 / 384
    whole = pagecache.read(str(tmp_path), max_files=100)
    assert whole.files == 7 and not whole.sampled
    assert pagecache.read(str(tmp_path / "missing")).files == 0
