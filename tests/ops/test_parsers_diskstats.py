"""diskstats (and iostat rates), mountinfo and /proc/<pid>/io parsers."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from ops.parsers import diskstats, mountinfo, procio

DEVVM = Path(__file__).resolve().parents[1] / "fixtures" / "devvm" / "proc"


@pytest.fixture(scope="module")
def vda() -> diskstats.DiskStat:
    return diskstats.parse((DEVVM / "diskstats").read_text())["vda"]


def test_diskstats_devvm_20_fields(vda: diskstats.DiskStat) -> None:
    # 254 0 vda 59452 14766 3887930 22930 10331 106171 5622264 25194 0 7552 48610
    #           5100 49 362832 460 631 25
    assert (vda.major, vda.minor) == (254, 0)
    assert (vda.reads, vda.reads_merged, vda.sectors_read, vda.read_ms) == (
        59452,
        14766,
        3887930,
        22930,
    )
    assert (vda.writes, vda.sectors_written, vda.write_ms) == (10331, 5622264, 25194)
    assert (vda.in_flight, vda.io_ms, vda.weighted_io_ms) == (0, 7552, 48610)
    assert (vda.discards, vda.sectors_discarded, vda.flushes, vda.flush_ms) == (
        5100,
        362832,
        631,
        25,
    )
    assert vda.read_bytes == 3887930 * 512 == 1990620160
    assert vda.written_bytes == 5622264 * 512


def test_diskstats_older_kernels_field_counts() -> None:
    # The captured vda line cut to the shapes of older kernels: 14 fields (< 4.18) and
    # 18 fields (4.18 .. 5.4); the fields they lack read as 0.
    line = next(line for line in (DEVVM / "diskstats").read_text().splitlines() if " vda " in line)
    fields = line.split()
    old = diskstats.parse(" ".join(fields[:14]))["vda"]
    assert old.weighted_io_ms == 48610 and old.discards == 0 and old.flushes == 0
    mid = diskstats.parse(" ".join(fields[:18]))["vda"]
    assert mid.discard_ms == 460 and mid.discards_merged == 49 and mid.flushes == 0
    assert diskstats.parse(" ".join(fields[:16])) == {}  # no kernel prints 16 fields


def test_rates_follow_sysstat(vda: diskstats.DiskStat) -> None:
    before = replace(
        vda,
        reads=vda.reads - 200,
        sectors_read=vda.sectors_read - 200 * 256,  # 128 KiB per read
        read_ms=vda.read_ms - 100,
        writes=vda.writes - 50,
        sectors_written=vda.sectors_written - 50 * 8,  # 4 KiB per write
        write_ms=vda.write_ms - 150,
        io_ms=vda.io_ms - 500,
        weighted_io_ms=vda.weighted_io_ms - 1000,
    )
    r = diskstats.rates(before, vda, 2.0)
    assert r is not None
    assert r.reads_per_second == 100.0  # 200 / 2 s
    assert r.writes_per_second == 25.0  # 50 / 2 s
    assert r.read_bytes_per_second == 200 * 256 * 512 / 2 == 13107200.0
    assert r.write_bytes_per_second == 50 * 8 * 512 / 2 == 102400.0
    assert r.read_await_seconds == 0.0005  # 100 ms / 200 reads = 0.5 ms
    assert r.write_await_seconds == 0.003  # 150 ms / 50 writes = 3 ms
    assert r.read_request_bytes == 131072.0 and r.write_request_bytes == 4096.0
    assert r.queue_size == 0.5  # 1000 ms of request time / 2000 ms
    assert r.utilization == 0.25  # 500 ms busy / 2000 ms


def test_rates_refuse_bad_intervals(vda: diskstats.DiskStat) -> None:
    assert diskstats.rates(vda, vda, 0.0) is None
    assert diskstats.rates(replace(vda, reads=vda.reads + 1), vda, 1.0) is None  # went back
    assert diskstats.rates(replace(vda, minor=1), vda, 1.0) is None
    idle = diskstats.rates(vda, vda, 1.0)
    assert idle is not None and idle.read_await_seconds == 0.0 and idle.utilization == 0.0


def test_mountinfo_devvm() -> None:
    mounts = mountinfo.parse((DEVVM / "self" / "mountinfo").read_text())
    # 27 1 254:0 / / rw,relatime - ext4 /dev/vda rw,...
    assert mounts == [mountinfo.Mount(27, 254, 0, "/", "/", "ext4", "/dev/vda")]
    assert mountinfo.mount_of(mounts, "/var/lib/kvtier") == mounts[0]


def test_mountinfo_longest_prefix_and_escapes() -> None:
    root = (DEVVM / "self" / "mountinfo").read_text().splitlines()[0]
    # A second line in the same shape, as a btrfs subvolume mounted on a path with a space.
    sub = "31 27 0:45 /@data /srv/kv\\040store rw,relatime shared:1 - btrfs /dev/nvme0n1p2 rw"
    mounts = mountinfo.parse(root + "\n" + sub + "\ngarbage\n")
    assert len(mounts) == 2 and mounts[1].mount_point == "/srv/kv store"
    assert mountinfo.mount_of(mounts, "/srv/kv store/l3") == mounts[1]
    assert mountinfo.mount_of(mounts, "/srv/kv storex") == mounts[0]


def test_procio_and_hit_ratio() -> None:
    text = "rchar: 6976\nwchar: 0\nsyscr: 10\nsyscw: 0\nread_bytes: 0\nwrite_bytes: 0\n"
    before = procio.parse(text)
    assert before == procio.ProcIo(rchar=6976, read_bytes=0)
    # 8 MiB read by the process, 2 MiB fetched from the device: 1 - 2/8 = 0.75 from cache
    after = procio.ProcIo(rchar=6976 + (8 << 20), read_bytes=2 << 20)
    assert procio.hit_ratio(before, after) == 0.75
    assert procio.hit_ratio(before, before) is None
    # readahead fetched more than was read: clamped to 0
    assert procio.hit_ratio(before, procio.ProcIo(6976 + 100, 4096)) == 0.0
    assert procio.parse("rchar: 1\n") is None
