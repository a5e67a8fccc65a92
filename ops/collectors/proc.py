"""Readers of the /proc memory sources: buddyinfo, meminfo, vmstat and PSI.

Each takes `root` (default `/proc`) so tests read captured trees, and returns None (or an empty
dict) when its file is missing: an old kernel, a container without PSI, a locked-down /proc.
"""

from __future__ import annotations

import os

from ops.collectors._files import read_text
from ops.parsers import buddyinfo, meminfo, pressure, procio, vmstat

RESOURCES = ("memory", "io", "cpu")


def page_size() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError):
        return 4096


def read_buddyinfo(root: str = "/proc", page: int | None = None) -> buddyinfo.BuddyInfo | None:
    text = read_text(os.path.join(root, "buddyinfo"))
    return None if text is None else buddyinfo.parse(text, page or page_size())


def read_meminfo(root: str = "/proc") -> meminfo.Meminfo | None:
    text = read_text(os.path.join(root, "meminfo"))
    return None if text is None else meminfo.parse(text)


def read_vmstat(root: str = "/proc") -> vmstat.Vmstat | None:
    text = read_text(os.path.join(root, "vmstat"))
    return None if text is None else vmstat.parse(text)


def read_pressure(root: str = "/proc") -> dict[str, pressure.Pressure]:
    """PSI per resource present (memory, io, cpu); empty without CONFIG_PSI or with psi=0."""
    out: dict[str, pressure.Pressure] = {}
    for resource in RESOURCES:
        text = read_text(os.path.join(root, "pressure", resource))
        if text is not None:
            out[resource] = pressure.parse(text)
    return out


def read_io(root: str = "/proc", pid: str = "self") -> procio.ProcIo | None:
    text = read_text(os.path.join(root, pid, "io"))
    return None if text is None else procio.parse(text)
