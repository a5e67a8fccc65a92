"""PCIe topology on sysfs trees: built from real path shapes, and the captured machines."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from ops.collectors import disk, pcie

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"

# Path shapes: the chipset switch of an AMD desktop (lspci -t in github.com/noonghunna/club-3090
# issue 851: root port 00:02.1, switch upstream 04:00.0, downstream 05:00.0 and 05:0c.0), a GPU
# on its own root port 00:01.1 (same tree), and a second host bridge pci0000:40 (issue 1322).
# NVMe block devices hang below the controller as nvme/nvme0/nvme0n1, multipath namespaces
# under virtual/nvme-subsystem/, device-mapper devices under virtual/block with `slaves`
# (the kernel's Documentation/ABI/testing/sysfs-block and drivers/nvme/host/multipath.c).
SWITCH = "devices/pci0000:00/0000:00:02.1/0000:04:00.0"
NVME_CTRL = f"{SWITCH}/0000:05:00.0/0000:06:00.0"
GPU_SHARED = f"{SWITCH}/0000:05:0c.0/0000:0f:00.0"
GPU_ROOT = "devices/pci0000:00/0000:00:01.1/0000:01:00.0"
GPU_AUDIO = "devices/pci0000:00/0000:00:01.1/0000:01:00.1"
GPU_OTHER = "devices/pci0000:40/0000:40:07.1/0000:41:00.0"


def _write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text + "\n")


def _link(root: Path, link: str, target: str) -> None:
    path = root / link
    path.parent.mkdir(parents=True, exist_ok=True)
    (root / target).mkdir(parents=True, exist_ok=True)
    path.symlink_to(os.path.relpath(root / target, path.parent))


def _pci(root: Path, rel: str, cls: str, vendor: str, width: int = 16, max_width: int = 16) -> None:
    d = root / rel
    _write(d / "class", cls)
    _write(d / "vendor", vendor)
    _write(d / "current_link_speed", "16.0 GT/s PCIe")
    _write(d / "max_link_speed", "16.0 GT/s PCIe")
    _write(d / "current_link_width", str(width))
    _write(d / "max_link_width", str(max_width))
    _link(root, f"bus/pci/devices/{rel.rsplit('/', 1)[1]}", rel)


def _server(root: Path, *, multipath: bool = False, dm: bool = False) -> None:
    _pci(root, NVME_CTRL, "0x010802", "0x144d", width=2, max_width=4)
    _pci(root, GPU_SHARED, "0x030200", "0x10de")
    _pci(root, GPU_ROOT, "0x030000", "0x10de")
    _pci(root, GPU_AUDIO, "0x040300", "0x10de")  # the GPU's audio function: not a GPU
    _pci(root, GPU_OTHER, "0x030200", "0x10de")
    ctrl = f"{NVME_CTRL}/nvme/nvme0"
    if multipath:
        disk_dir = "devices/virtual/nvme-subsystem/nvme-subsys0/nvme0n1"
        _link(root, "devices/virtual/nvme-subsystem/nvme-subsys0/nvme0", ctrl)
    else:
        disk_dir = f"{ctrl}/nvme0n1"
    _write(root / disk_dir / "dev", "259:0")
    _write(root / disk_dir / "nvme0n1p1" / "dev", "259:1")
    _write(root / disk_dir / "nvme0n1p1" / "partition", "1")
    _link(root, "dev/block/259:0", disk_dir)
    _link(root, "dev/block/259:1", f"{disk_dir}/nvme0n1p1")
    if dm:
        _write(root / "devices/virtual/block/dm-0/dev", "253:0")
        _link(root, "devices/virtual/block/dm-0/slaves/nvme0n1p1", f"{disk_dir}/nvme0n1p1")
        _link(root, "dev/block/253:0", "devices/virtual/block/dm-0")


def _levels(findings: list[pcie.TopologyFinding]) -> dict[str, str]:
    return {f.gpu: f.level for f in findings}


@pytest.mark.parametrize(
    ("multipath", "dm", "dev", "name"),
    [
        (False, False, (259, 1), "nvme0n1"),  # a partition resolves to its whole disk
        (True, False, (259, 0), "nvme0n1"),  # native NVMe multipath namespace
        (False, True, (253, 0), "dm-0"),  # LVM on a partition of the drive
    ],
)
def test_gpu_sharing_the_switch_is_found(
    tmp_path: Path, multipath: bool, dm: bool, dev: tuple[int, int], name: str
) -> None:
    _server(tmp_path, multipath=multipath, dm=dm)
    device = disk.block_device(*dev, sys_root=str(tmp_path))
    assert device is not None and device.name == name
    findings = pcie.read_topology("unused", str(tmp_path), device=device)
    assert _levels(findings) == {
        "0000:01:00.0": "host_bridge",
        "0000:0f:00.0": "switch",
        "0000:41:00.0": "none",
    }
    shared = next(f for f in findings if f.level == "switch")
    assert shared.contended and shared.common == "0000:04:00.0"
    assert shared.drive == "0000:06:00.0" and shared.device == name
    assert "share PCIe switch port 0000:04:00.0" in shared.message
    # the drive's link trains x2 of x4 in this tree: reported as downgraded
    assert shared.drive_link.width == 2 and shared.drive_link.downgraded
    assert not shared.gpu_link.downgraded


def test_no_gpu_or_no_device_gives_nothing(tmp_path: Path) -> None:
    assert pcie.read_topology("/nonexistent", str(tmp_path)) == []
    devvm = FIXTURES / "devvm"
    device = disk.block_device(254, 0, sys_root=str(devvm / "sys"))
    assert device is not None and device.name == "vda"
    assert pcie.gpus(str(devvm / "sys")) == []  # a VM with virtio disks and no GPU
    assert pcie.read_topology("unused", str(devvm / "sys"), device=device) == []
    assert pcie.drive_functions(device.sys_path)[0].endswith("pci0000:00/0000:00:02.0")


GPU_HOST = FIXTURES / "gpu-h200"


@pytest.mark.skipif(not (GPU_HOST / "sys").is_dir(), reason="GPU machine capture not present")
def test_captured_gpu_machine() -> None:
    """The GPU machine's own tree: every NVML GPU is found in sysfs and placed."""
    import json

    sys_root = str(GPU_HOST / "sys")
    found = {os.path.basename(p) for p in pcie.gpus(sys_root)}
    dump = json.loads((GPU_HOST / "nvml.json").read_text())
    from ops.parsers.nvml import parse_device

    nvml_ids = {parse_device(raw).pci_address for raw in dump["devices"]}
    assert nvml_ids and nvml_ids <= found
    major, minor = (int(n) for n in (GPU_HOST / "stat_dev.txt").read_text().split()[0].split(":"))
    device = disk.block_device(major, minor, sys_root=sys_root)
    if device is None:
        pytest.skip("the root filesystem of the GPU machine is not on a block device")
    findings = pcie.read_topology("unused", sys_root, device=device)
    for finding in findings:
        assert finding.level in ("switch", "root_port", "host_bridge", "none")
        assert finding.gpu in found
