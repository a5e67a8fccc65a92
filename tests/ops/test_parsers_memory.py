"""meminfo, vmstat and PSI parsers on the captured devvm files (values checked by hand)."""

from __future__ import annotations

from pathlib import Path

from ops.parsers import meminfo, pressure, vmstat

DEVVM = Path(__file__).resolve().parents[1] / "fixtures" / "devvm" / "proc"


def test_meminfo_devvm() -> None:
    info = meminfo.parse((DEVVM / "meminfo").read_text())
    assert info.mem_total == 24683652 * 1024 == 25276059648
    assert info.mem_available == 23019564 * 1024 == 23572033536
    assert info.cached == 860188 * 1024
    assert info.dirty == 2036 * 1024 == 2084864
    assert info.writeback == 0
    assert info.mlocked == 13184 * 1024
    assert info.unevictable == 14248 * 1024
    # hugepage counts are pages, not kB; the page size is kB
    assert (info.hugepages_total, info.hugepages_free) == (0, 0)
    assert (info.hugepages_reserved, info.hugepages_surplus) == (0, 0)
    assert info.hugepage_size == 2048 * 1024 == 2097152
    assert info.hugepages_available == 0
    assert info.fields["WritebackTmp"] == 0


def test_meminfo_missing_keys_are_none() -> None:
    info = meminfo.parse("MemTotal: 100 kB\nbogus line\nHugePages_Total:   4\n")
    assert info.mem_total == 102400 and info.hugepages_total == 4
    assert info.mem_available is None and info.hugepages_available is None


def test_vmstat_devvm() -> None:
    stat = vmstat.parse((DEVVM / "vmstat").read_text())
    assert stat.pgmajfault == 1089
    assert stat.allocstall == 0  # sum of allocstall_{dma,dma32,normal,movable,device}
    assert (stat.compact_stall, stat.compact_fail) == (0, 0)
    assert stat.workingset_refault_file == 268758
    assert stat.pgscan_direct == 0
    assert stat.oom_kill == 0
    assert (stat.nr_dirty, stat.nr_writeback) == (509, 0)
    assert stat.nr_dirty_threshold == 1147959
    assert stat.nr_dirty_background_threshold == 573278


def test_vmstat_older_kernel_names() -> None:
    # Before 4.10 allocstall was one counter; before 5.9 workingset_refault had no _file split.
    stat = vmstat.parse("allocstall 7\nworkingset_refault 11\npgscan_direct_normal 3\n")
    assert (stat.allocstall, stat.workingset_refault_file, stat.pgscan_direct) == (7, 11, 3)
    assert stat.oom_kill is None


def test_pressure_devvm() -> None:
    cpu = pressure.parse((DEVVM / "pressure" / "cpu").read_text())
    # some avg10=61.85 avg60=35.56 avg300=11.81 total=45971639 (us)
    assert cpu.some == pressure.Stall(0.6185, 0.3556, 0.1181, 45.971639)
    assert cpu.full == pressure.Stall(0.0, 0.0, 0.0, 0.0)
    io = pressure.parse((DEVVM / "pressure" / "io").read_text())
    # some avg60=0.08 total=3545198; full avg300=0.15 total=3157372
    assert io.some is not None and io.some.avg60 == 0.0008
    assert io.some.total_seconds == 3.545198
    assert io.full is not None and io.full.avg300 == 0.0015
    assert io.full.total_seconds == 3.157372
    memory = pressure.parse((DEVVM / "pressure" / "memory").read_text())
    assert memory.some is not None and memory.some.total_seconds == 0.0


def test_pressure_without_full_line() -> None:
    # cpu before 5.13 printed only the `some` line.
    only_some = (DEVVM / "pressure" / "cpu").read_text().splitlines()[0]
    parsed = pressure.parse(only_some)
    assert parsed.full is None and parsed.some is not None
    assert pressure.parse("") == pressure.Pressure(None, None)
