"""PCIe placement from sysfs path ancestry: do a GPU and an NVMe drive share a switch?

A device's directory under /sys/devices spells its path from the CPU:
`pci0000:00/0000:00:01.0/0000:01:00.0/0000:02:00.0/0000:03:00.0` is host bridge `pci0000:00`,
root port `0000:00:01.0`, then the bridges of a PCIe switch (upstream port `0000:01:00.0`,
downstream port `0000:02:00.0`) and the endpoint `0000:03:00.0`. Two endpoints that share a
bridge below the root port share that switch's uplink: heavy SSD traffic then competes with
host<->GPU copies (the "SSD writes slow the GPU" pitfall). Pure string work on resolved paths.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Literal

BDF = re.compile(r"^[0-9a-f]{4}:[0-9a-f]{2}:[0-9a-f]{2}\.[0-7]$")
HOST_BRIDGE = re.compile(r"^pci[0-9a-f]{4}:[0-9a-f]{2}$")

Level = Literal["switch", "root_port", "host_bridge", "none"]


@dataclass(frozen=True)
class Placement:
    """A device's position: its host bridge and the chain of PCI functions down to it."""

    host_bridge: str | None  # `pci0000:00`; None when the path is not under a host bridge
    chain: tuple[str, ...]  # bus ids from the root port (or root-bus device) to the endpoint

    @property
    def endpoint(self) -> str | None:
        return self.chain[-1] if self.chain else None


def placement(path: str) -> Placement:
    """The placement encoded in a resolved sysfs path (anything after the last bus id is ignored,
    such as `nvme/nvme0/nvme0n1` below an NVMe controller)."""
    host: str | None = None
    chain: list[str] = []
    for part in path.split("/"):
        if HOST_BRIDGE.match(part):
            host, chain = part, []
        elif BDF.match(part) and host is not None:
            chain.append(part)
    return Placement(host_bridge=host, chain=tuple(chain))


@dataclass(frozen=True)
class Shared:
    """How two endpoints share the path to the CPU."""

    level: Level
    common: str | None  # the deepest shared bridge, or the shared host bridge


def sharing(a: Placement, b: Placement) -> Shared:
    """Classify two endpoints: a shared switch (a common bridge below the root port), a shared
    root port, the same host bridge only, or nothing."""
    if a.host_bridge is None or a.host_bridge != b.host_bridge:
        return Shared("none", None)
    bridges_a, bridges_b = a.chain[:-1], b.chain[:-1]
    common: list[str] = []
    for x, y in zip(bridges_a, bridges_b, strict=False):
        if x != y:
            break
        common.append(x)
    if len(common) >= 2:
        return Shared("switch", common[-1])
    if len(common) == 1:
        return Shared("root_port", common[0])
    return Shared("host_bridge", a.host_bridge)


def describe(level: Level, gpu: str, nvme: str, common: str | None) -> str:
    """One line for an operator: what is shared and what it costs."""
    if level == "switch":
        return (
            f"GPU {gpu} and L3 NVMe {nvme} share PCIe switch port {common}: SSD traffic competes"
            " with host<->GPU copies on its uplink; put the L3 on a drive under another switch"
            " or limit its write bandwidth (IOWriteBandwidthMax)"
        )
    if level == "root_port":
        return (
            f"GPU {gpu} and L3 NVMe {nvme} share root port {common}: they split one link to the"
            " CPU; put the L3 on a drive under another root port"
        )
    if level == "host_bridge":
        return f"GPU {gpu} and L3 NVMe {nvme} sit under host bridge {common} on separate links"
    return f"GPU {gpu} and L3 NVMe {nvme} share no PCIe path"
