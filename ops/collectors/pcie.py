"""PCIe topology from sysfs: does each GPU share a switch or root port with the L3 drive?

GPUs are the PCI functions of display class (0x03xxxx) from NVIDIA or AMD under
`<sys>/bus/pci/devices`. The L3 drive is the block device under the L3 root, followed to its
PCI function: directly (`.../0000:5e:00.0/nvme/nvme0/nvme0n1`), through an NVMe multipath
subsystem (`virtual/nvme-subsystem/nvme-subsys0/nvme0 -> controller`), or through the `slaves`
of a device-mapper or md device (LVM, RAID): every member drive is checked.
"""

from __future__ import annotations

import glob
import os
from dataclasses import dataclass

from ops.collectors import disk
from ops.collectors._files import read_attr
from ops.parsers import pcie

GPU_VENDORS = {"0x10de", "0x1002"}  # NVIDIA, AMD


@dataclass(frozen=True)
class Link:
    """A function's PCIe link state from sysfs (None on virtual devices and old kernels)."""

    speed: str | None  # e.g. "32.0 GT/s PCIe"
    width: int | None
    max_speed: str | None
    max_width: int | None

    @property
    def downgraded(self) -> bool:
        """Runs narrower or slower than it can (speed compared by its GT/s figure)."""

        def gts(value: str | None) -> float | None:
            try:
                return float(value.split()[0]) if value else None
            except ValueError:
                return None

        width, max_width = self.width, self.max_width
        narrow = width is not None and max_width is not None and width < max_width
        cur, top = gts(self.speed), gts(self.max_speed)
        return bool(narrow or (cur is not None and top is not None and cur < top))


@dataclass(frozen=True)
class TopologyFinding:
    """One GPU against one drive under the L3 root."""

    gpu: str  # PCI bus id, sysfs form
    drive: str  # PCI bus id of the drive's controller
    device: str  # block device name under the L3 root (nvme0n1, dm-0)
    level: pcie.Level  # "switch", "root_port", "host_bridge" or "none"
    common: str | None
    gpu_path: str
    drive_path: str
    gpu_link: Link
    drive_link: Link
    message: str

    @property
    def contended(self) -> bool:
        """The GPU and the drive share a link to the CPU (a switch uplink or a root port)."""
        return self.level in ("switch", "root_port")


def _int(value: str | None) -> int | None:
    try:
        return int(value) if value is not None else None
    except ValueError:
        return None


def link(path: str) -> Link:
    return Link(
        speed=read_attr(path, "current_link_speed"),
        width=_int(read_attr(path, "current_link_width")),
        max_speed=read_attr(path, "max_link_speed"),
        max_width=_int(read_attr(path, "max_link_width")),
    )


def gpus(sys_root: str = "/sys") -> list[str]:
    """Resolved sysfs paths of the GPUs, in bus order."""
    found = []
    for entry in sorted(glob.glob(os.path.join(sys_root, "bus", "pci", "devices", "*"))):
        cls = read_attr(entry, "class") or ""
        if cls.startswith("0x03") and read_attr(entry, "vendor") in GPU_VENDORS:
            found.append(os.path.realpath(entry))
    return found


def _function_dir(path: str) -> str | None:
    """The deepest PCI function directory in a resolved path."""
    parts = path.split("/")
    for i in range(len(parts), 0, -1):
        if pcie.BDF.match(parts[i - 1]):
            return "/".join(parts[:i])
    return None


def drive_functions(device_path: str, depth: int = 0) -> list[str]:
    """PCI function directories that carry a block device's I/O (several for RAID or LVM)."""
    path = os.path.realpath(device_path)
    slaves = sorted(glob.glob(os.path.join(path, "slaves", "*")))
    if slaves and depth < 8:
        return [f for s in slaves for f in drive_functions(s, depth + 1)]
    if "/nvme-subsystem/" in path:
        subsystem = os.path.dirname(path)
        controllers = sorted(glob.glob(os.path.join(subsystem, "nvme[0-9]*")))
        found = [_function_dir(os.path.realpath(c)) for c in controllers if os.path.islink(c)]
        return [f for f in found if f]
    found_dir = _function_dir(path)
    return [found_dir] if found_dir else []


def read_topology(
    l3_path: str, sys_root: str = "/sys", *, device: disk.BlockDevice | None = None
) -> list[TopologyFinding]:
    """Per GPU and per drive under `l3_path`, how they share the PCIe path to the CPU.

    Empty when there is no GPU, or the L3 drive is not a PCI device (a virtual disk, tmpfs).
    `device` skips the st_dev lookup (tests resolve captured trees with a recorded st_dev).
    """
    device = device or disk.device_of(l3_path, sys_root=sys_root)
    gpu_paths = gpus(sys_root)
    if device is None or not gpu_paths:
        return []
    findings = []
    for drive_path in drive_functions(device.sys_path):
        drive_at = pcie.placement(drive_path)
        for gpu_path in gpu_paths:
            gpu_at = pcie.placement(gpu_path)
            shared = pcie.sharing(gpu_at, drive_at)
            gpu_id, drive_id = gpu_at.endpoint or "?", drive_at.endpoint or "?"
            findings.append(
                TopologyFinding(
                    gpu=gpu_id,
                    drive=drive_id,
                    device=device.name,
                    level=shared.level,
                    common=shared.common,
                    gpu_path=gpu_path,
                    drive_path=drive_path,
                    gpu_link=link(gpu_path),
                    drive_link=link(drive_path),
                    message=pcie.describe(shared.level, gpu_id, drive_id, shared.common),
                )
            )
    return findings
