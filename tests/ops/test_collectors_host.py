"""Readers and sample() on captured trees, on a missing tree, and live on this machine."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from ops.collectors import HostSnapshot, disk, nvml, proc, sample, torch_alloc

DEVVM = Path(__file__).resolve().parents[1] / "fixtures" / "devvm"
PROC, SYS = str(DEVVM / "proc"), str(DEVVM / "sys")


def test_readers_on_the_capture() -> None:
    info = proc.read_buddyinfo(PROC, page=4096)
    assert info is not None and info.headroom_bytes() == (7 + 1506 + 354) * 2097152
    meminfo = proc.read_meminfo(PROC)
    assert meminfo is not None and meminfo.mem_available == 23019564 * 1024
    vmstat = proc.read_vmstat(PROC)
    assert vmstat is not None and vmstat.pgmajfault == 1089
    assert sorted(proc.read_pressure(PROC)) == ["cpu", "io", "memory"]


def test_missing_files_give_empty_results(tmp_path: Path) -> None:
    root = str(tmp_path)
    assert proc.read_buddyinfo(root) is None
    assert proc.read_meminfo(root) is None
    assert proc.read_vmstat(root) is None
    assert proc.read_pressure(root) == {}
    assert proc.read_io(root) is None
    assert disk.block_device(254, 0, sys_root=root) is None
    assert disk.device_of(str(tmp_path / "nope")) is None
    snap = sample(str(tmp_path / "nope"), proc_root=root, sys_root=root, nvml=False)
    assert snap.buddyinfo is None and snap.meminfo is None and snap.vmstat is None
    assert snap.pressure == {} and snap.disk is None and snap.gpus == [] and snap.topology == []
    assert snap.pagecache is not None and snap.pagecache.files == 0
    assert snap.pagecache.resident_ratio is None


def test_disk_from_the_capture() -> None:
    device = disk.block_device(254, 0, sys_root=SYS)  # stat_dev.txt: "254:0 /"
    assert device is not None
    assert (device.name, device.major, device.minor, device.rotational) == ("vda", 254, 0, True)
    reading = disk.read("unused", proc_root=PROC, device=device)
    assert reading is not None and reading.stat.reads == 59452 and reading.rates is None


def test_sample_on_the_capture_has_every_source() -> None:
    snap = sample(proc_root=PROC, sys_root=SYS, nvml=False)
    assert isinstance(snap, HostSnapshot)
    assert snap.buddyinfo is not None and snap.meminfo is not None and snap.vmstat is not None
    assert snap.pressure["cpu"].some is not None
    assert snap.pressure["cpu"].some.avg10 == 0.6185
    assert snap.disk is None and snap.pagecache is None  # no L3 root given
    with pytest.raises(AttributeError):
        snap.taken_at = 0.0  # type: ignore[misc]  # frozen


def test_live_iostat_rates_count_our_own_writes(tmp_path: Path) -> None:
    device = disk.device_of(str(tmp_path))
    if device is None:
        pytest.skip("the temporary directory is not on a block device here")
    first = sample(str(tmp_path), nvml=False)
    assert first.disk is not None and first.disk.rates is None
    payload = os.urandom(1 << 20)
    for i in range(4):  # 4 MiB written and fsynced: the device must see at least that
        with open(tmp_path / f"f{i}", "wb") as f:
            f.write(payload)
            f.flush()
            os.fsync(f.fileno())
    time.sleep(0.05)
    second = sample(str(tmp_path), previous=first, nvml=False)
    assert second.disk is not None and second.disk.rates is not None
    rates = second.disk.rates
    interval = second.taken_at - first.taken_at
    assert rates.interval_seconds == interval
    written = second.disk.stat.written_bytes - first.disk.stat.written_bytes
    assert written >= 4 << 20
    assert rates.write_bytes_per_second == written / interval
    assert rates.writes_per_second > 0 and 0.0 <= rates.utilization <= 1.0


def test_nvml_degrades_to_no_gpu() -> None:
    if nvml.device_count():
        pytest.skip("a GPU is present: the no-driver path cannot be exercised here")
    assert nvml.nvml_query("nvmlDeviceGetCount") is nvml.NA
    assert not nvml.NA and repr(nvml.NA) == "N/A"
    assert nvml.nvml_query("nvmlDeviceGetCount", default=-1) == -1
    assert nvml.read() == [] and nvml.read_raw() == []
    dump = nvml.dump()
    assert dump["devices"] == [] and dump["driver_version"] is None
    assert sample(nvml=True).gpus == []


def test_torch_alloc_is_none_without_cuda() -> None:
    import torch

    if torch.cuda.is_available() and torch.cuda.is_initialized():
        pytest.skip("CUDA is initialized in this process")
    assert torch_alloc.read() is None


def test_torch_alloc_from_stats() -> None:
    # The keys torch.cuda.memory_stats() and memory_snapshot() return (torch 2.x).
    stats = {
        "reserved_bytes.all.current": 64 << 20,
        "allocated_bytes.all.current": 40 << 20,
        "inactive_split_bytes.all.current": 3 << 20,
        "num_alloc_retries": 2,
        "num_ooms": 1,
    }
    segments = [
        {"device": 0, "blocks": [{"size": 20 << 20, "state": "active_allocated"}]},
        {"device": 0, "blocks": [{"size": 5 << 20, "state": "inactive"}]},
        {"device": 0, "blocks": [{"size": 2 << 20, "state": "inactive"}]},
        {"device": 1, "blocks": [{"size": 9 << 20, "state": "inactive"}]},  # other device
    ]
    state = torch_alloc.from_stats(0, stats, segments)
    assert state.reserved_unused_bytes == 24 << 20  # 64 - 40 MiB
    assert state.inactive_split_bytes == 3 << 20
    assert (state.alloc_retries, state.ooms) == (2, 1)
    assert state.largest_free_block_bytes == 5 << 20


@pytest.mark.gpu
@pytest.mark.skipif(
    not __import__("torch").cuda.is_available(), reason="needs CUDA (run on a GPU machine)"
)
def test_torch_alloc_on_a_gpu() -> None:
    import torch

    blocks = [torch.empty(1 << 20, dtype=torch.uint8, device="cuda") for _ in range(8)]
    del blocks[::2]  # free every other block: cached, inactive
    states = torch_alloc.read()
    assert states is not None and states[0].reserved_bytes >= 4 << 20
    assert states[0].allocated_bytes >= 4 << 20
    assert states[0].largest_free_block_bytes >= 1 << 20
    readings = nvml.read()
    assert readings and readings[0].memory_total_bytes
