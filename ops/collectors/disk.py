"""The block device under a directory, and its /proc/diskstats counters.

st_dev of the directory resolves through /sys/dev/block/<major>:<minor> to a sysfs directory;
a partition's parent directory is its whole disk, whose counters iostat reports. Filesystems
with an anonymous st_dev (btrfs, overlayfs: major 0) are resolved through the mount's source
device in mountinfo.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from ops.collectors._files import read_attr, read_text
from ops.parsers import diskstats, mountinfo


@dataclass(frozen=True)
class BlockDevice:
    """A whole disk (or a device-mapper/md device) as sysfs names it."""

    name: str
    major: int
    minor: int
    sys_path: str  # resolved sysfs directory of the device
    rotational: bool | None


@dataclass(frozen=True)
class DiskReading:
    """Counters of the device under the L3 root, and iostat rates when a previous one was given."""

    device: BlockDevice
    stat: diskstats.DiskStat
    rates: diskstats.IoRates | None = None


def _device_at(sys_dir: str) -> BlockDevice | None:
    if not os.path.isdir(sys_dir):
        return None
    path = os.path.realpath(sys_dir)
    if read_attr(path, "partition") is not None:
        path = os.path.dirname(path)
    dev = read_attr(path, "dev")
    if dev is None or ":" not in dev:
        return None
    major, minor = (int(n) for n in dev.split(":", 1))
    rotational = read_attr(path, "queue/rotational")
    return BlockDevice(
        name=os.path.basename(path),
        major=major,
        minor=minor,
        sys_path=path,
        rotational=None if rotational is None else rotational == "1",
    )


def block_device(major: int, minor: int, sys_root: str = "/sys") -> BlockDevice | None:
    """The whole disk holding device number major:minor; None when sysfs does not know it."""
    return _device_at(os.path.join(sys_root, "dev", "block", f"{major}:{minor}"))


def device_of(path: str, *, sys_root: str = "/sys", proc_root: str = "/proc") -> BlockDevice | None:
    """The block device under `path`; None for a missing path or a device-less filesystem."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    major, minor = os.major(st.st_dev), os.minor(st.st_dev)
    if major != 0:
        return block_device(major, minor, sys_root)
    text = read_text(os.path.join(proc_root, "self", "mountinfo"))
    mount = mountinfo.mount_of(mountinfo.parse(text or ""), os.path.realpath(path))
    if mount is None or not mount.source.startswith("/dev/"):
        return None
    name = os.path.basename(os.path.realpath(mount.source))
    for parent in ("class/block", "block"):
        device = _device_at(os.path.join(sys_root, parent, name))
        if device is not None:
            return device
    return None


def read_stat(device: BlockDevice, proc_root: str = "/proc") -> diskstats.DiskStat | None:
    text = read_text(os.path.join(proc_root, "diskstats"))
    if text is None:
        return None
    for stat in diskstats.parse(text).values():
        if (stat.major, stat.minor) == (device.major, device.minor):
            return stat
    return None


def read(
    path: str,
    *,
    proc_root: str = "/proc",
    sys_root: str = "/sys",
    device: BlockDevice | None = None,
) -> DiskReading | None:
    """Counters of the device under `path` (or of `device`); None when either is unknown."""
    device = device or device_of(path, sys_root=sys_root, proc_root=proc_root)
    if device is None:
        return None
    stat = read_stat(device, proc_root)
    return None if stat is None else DiskReading(device=device, stat=stat)
