"""GPU readings from raw NVML values (the dicts `ops.collectors.nvml.read_raw` returns).

Pure: the input is the JSON-able dict of one device (or the capture script's JSON text), so the
interpretation of NVML units is tested on captured readings without a GPU.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

KIB = 1024


@dataclass(frozen=True)
class GpuReading:
    """One GPU as NVML sees it; None where NVML gave no value (old driver, not supported)."""

    index: int
    name: str | None
    bus_id: str | None
    uuid: str | None
    memory_total_bytes: int | None
    memory_used_bytes: int | None
    memory_free_bytes: int | None
    memory_reserved_bytes: int | None
    pcie_tx_bytes_per_second: int | None
    pcie_rx_bytes_per_second: int | None
    link_gen: int | None
    link_gen_max: int | None
    link_gen_gpu_max: int | None
    link_width: int | None
    link_width_max: int | None
    replay_counter: int | None
    utilization_gpu_ratio: float | None

    @property
    def pci_address(self) -> str | None:
        """The bus id in sysfs form (`0000:18:00.0`): NVML pads the domain to 8 hex digits."""
        return normalize_bus_id(self.bus_id) if self.bus_id else None

    def link_findings(self) -> list[str]:
        """What is wrong with this GPU's PCIe link, in words an operator can act on.

        A lower *width* than the maximum is a physical problem (a badly seated card, a riser, a
        BIOS lane split). A lower *generation* is normal while the GPU idles (the driver lowers
        link speed to save power), so it is reported with that caveat; a slot maximum below the
        GPU's own maximum means the slot or a switch caps the link.
        """
        findings: list[str] = []
        width, width_max = self.link_width, self.link_width_max
        gen, gen_max, gpu_max = self.link_gen, self.link_gen_max, self.link_gen_gpu_max
        if width is not None and width_max is not None and width < width_max:
            findings.append(
                f"GPU {self.index}: PCIe link runs x{width} of x{width_max}"
                " (reseat the card or check the riser and BIOS lane settings)"
            )
        if gen is not None and gen_max is not None and gen < gen_max:
            findings.append(
                f"GPU {self.index}: PCIe link at Gen{gen} of Gen{gen_max}"
                " (normal while idle: the driver lowers the link speed; a problem under load)"
            )
        if gen_max is not None and gpu_max is not None and gen_max < gpu_max:
            findings.append(
                f"GPU {self.index}: slot caps the link at Gen{gen_max}; the GPU"
                f" supports Gen{gpu_max} (move it to a faster slot)"
            )
        return findings


def normalize_bus_id(bus_id: str) -> str:
    """`00000000:18:00.0` (NVML) -> `0000:18:00.0` (sysfs), lower case."""
    bus_id = bus_id.strip().lower()
    domain, sep, rest = bus_id.partition(":")
    if not sep:
        return bus_id
    return f"{int(domain, 16):04x}:{rest}"


def _int(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _str(value: Any) -> str | None:
    return value if isinstance(value, str) else None


def _kib(value: Any) -> int | None:
    number = _int(value)
    return None if number is None else number * KIB


def parse_device(raw: Mapping[str, Any]) -> GpuReading:
    """One device dict (keys of `ops.collectors.nvml.FIELDS`) -> GpuReading.

    Memory comes in bytes. PCIe throughput comes in KB/s (NVML's unit, 1 KB = 1024 bytes as
    nvidia-smi and nvitop read it) and is returned in bytes per second.
    """
    memory = raw.get("memory")
    memory = memory if isinstance(memory, Mapping) else {}
    pci = raw.get("pci")
    bus_id = None
    if isinstance(pci, Mapping):
        bus_id = _str(pci.get("busId")) or _str(pci.get("busIdLegacy"))
    utilization = raw.get("utilization")
    gpu_util = None
    if isinstance(utilization, Mapping) and _int(utilization.get("gpu")) is not None:
        gpu_util = utilization["gpu"] / 100
    return GpuReading(
        index=int(raw.get("index", 0)),
        name=_str(raw.get("name")),
        bus_id=bus_id,
        uuid=_str(raw.get("uuid")),
        memory_total_bytes=_int(memory.get("total")),
        memory_used_bytes=_int(memory.get("used")),
        memory_free_bytes=_int(memory.get("free")),
        memory_reserved_bytes=_int(memory.get("reserved")),
        pcie_tx_bytes_per_second=_kib(raw.get("pcie_tx")),
        pcie_rx_bytes_per_second=_kib(raw.get("pcie_rx")),
        link_gen=_int(raw.get("link_gen")),
        link_gen_max=_int(raw.get("link_gen_max")),
        link_gen_gpu_max=_int(raw.get("link_gen_gpu_max")),
        link_width=_int(raw.get("link_width")),
        link_width_max=_int(raw.get("link_width_max")),
        replay_counter=_int(raw.get("replay_counter")),
        utilization_gpu_ratio=gpu_util,
    )


def parse(text: str) -> list[GpuReading]:
    """The capture script's NVML JSON dump -> one GpuReading per device (empty without GPUs)."""
    if not text.strip():
        return []
    data = json.loads(text)
    devices = data.get("devices", []) if isinstance(data, Mapping) else []
    return [parse_device(raw) for raw in devices if isinstance(raw, Mapping)]
