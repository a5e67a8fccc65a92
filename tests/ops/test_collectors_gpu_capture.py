"""The H200 machine's capture (tests/fixtures/gpu-h200): exact values computed by hand.

That machine is a VM with the GPU passed through: sysfs shows the virtual topology (GPU and
virtio disk both on the root bus of pci0000:00), not the physical switches of the host.
"""

from __future__ import annotations

from pathlib import Path

from ops.collectors import disk, pcie, proc, sample
from ops.parsers import nvml

HOST = Path(__file__).resolve().parents[1] / "fixtures" / "gpu-h200"
PROC, SYS = str(HOST / "proc"), str(HOST / "sys")


def test_nvml_readings() -> None:
    (gpu,) = nvml.parse((HOST / "nvml.json").read_text())
    assert gpu.name == "NVIDIA H200" and gpu.pci_address == "0000:00:06.0"
    # v2 memory struct: total = reserved + free + used = 644939776 + 150109880320 + 0
    assert gpu.memory_total_bytes == 150754820096 == 644939776 + 150109880320 + 0
    assert gpu.memory_reserved_bytes == 644939776 and gpu.memory_used_bytes == 0
    assert gpu.pcie_tx_bytes_per_second == 1524 * 1024 == 1560576
    assert gpu.pcie_rx_bytes_per_second == 570 * 1024 == 583680
    assert (gpu.link_gen, gpu.link_gen_max, gpu.link_width, gpu.link_width_max) == (5, 5, 16, 16)
    assert gpu.replay_counter == 0 and gpu.link_findings() == []


def test_buddyinfo_and_meminfo() -> None:
    info = proc.read_buddyinfo(PROC, page=4096)
    assert info is not None
    normal = info.zone(0, "Normal")
    assert normal is not None
    # 310 + 367*2 + 129*4 + 24*8 + 10*16 + 24*32 + 37*64 + 21*128 + 15*256 + 11*512 + 37*1024
    # = 310 + 734 + 516 + 192 + 160 + 768 + 2368 + 2688 + 3840 + 5632 + 37888 = 55096 pages
    assert normal.free_pages == 55096
    # 2 MiB headroom: 11 order-9 blocks + 37 order-10 blocks x 2 = 85 blocks of 2 MiB
    assert normal.headroom_bytes() == 85 * 2097152 == 178257920
    # unusable at order 9: (55096 - 85*512) * 1000 // 55096 = 11576000 // 55096 = 210
    assert normal.unusable_index(9) == 0.21
    meminfo = proc.read_meminfo(PROC)
    assert meminfo is not None and meminfo.mem_total == 131981020 * 1024
    assert meminfo.mem_available == 131504340 * 1024


def test_disk_and_topology() -> None:
    # stat_dev.txt: "254:0 /tmp/l3root": the L3 root of that run sat on vda
    device = disk.block_device(254, 0, sys_root=SYS)
    assert device is not None and device.name == "vda"
    reading = disk.read("unused", proc_root=PROC, device=device)
    # 254 0 vda 2854 912 1286354 2226 156 191 2984 59 0 1104 2287 8 0 296 1 7 0
    assert reading is not None and reading.stat.reads == 2854
    assert reading.stat.read_bytes == 1286354 * 512
    assert [p.rsplit("/", 1)[1] for p in pcie.gpus(SYS)] == ["0000:00:06.0"]
    (finding,) = pcie.read_topology("unused", SYS, device=device)
    assert (finding.gpu, finding.drive, finding.level) == (
        "0000:00:06.0",
        "0000:00:01.0",
        "host_bridge",
    )
    assert finding.common == "pci0000:00" and not finding.contended
    # the GPU's sysfs link: 32.0 GT/s x16 of 32.0 GT/s x16 (Gen5)
    assert finding.gpu_link == pcie.Link("32.0 GT/s PCIe", 16, "32.0 GT/s PCIe", 16)
    assert not finding.gpu_link.downgraded


def test_sample_on_the_capture() -> None:
    snap = sample(proc_root=PROC, sys_root=SYS, nvml=False)
    assert snap.vmstat is not None and snap.vmstat.pgmajfault == 397
    assert snap.pressure["memory"].full is not None
