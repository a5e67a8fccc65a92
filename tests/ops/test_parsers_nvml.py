"""NVML readings: unit conversion and link findings, and the GPU machine's captured dump."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ops.parsers import nvml

GPU_DUMP = Path(__file__).resolve().parents[1] / "fixtures" / "gpu-h200" / "nvml.json"

# One device as ops.collectors.nvml.read_raw() returns it (keys of FIELDS; structs as dicts).
RAW = {
    "index": 0,
    "name": "NVIDIA H200",
    "uuid": "GPU-00000000-0000-0000-0000-000000000000",
    "pci": {"busId": "00000000:18:00.0", "domain": 0, "bus": 24, "device": 0},
    "memory": {
        "total": 150754820096,
        "reserved": 577830912,
        "free": 149600665600,
        "used": 576323584,
    },
    "pcie_tx": 1500,
    "pcie_rx": 250000,
    "link_gen": 5,
    "link_gen_max": 5,
    "link_gen_gpu_max": 5,
    "link_width": 16,
    "link_width_max": 16,
    "replay_counter": 0,
    "utilization": {"gpu": 37, "memory": 5},
}


def test_parse_device_units() -> None:
    reading = nvml.parse_device(json.loads(json.dumps(RAW)))  # as read back from the dump
    assert reading.bus_id == "00000000:18:00.0"
    assert reading.pci_address == "0000:18:00.0"  # NVML pads the domain to 8 digits
    assert reading.memory_total_bytes == 150754820096
    assert reading.memory_reserved_bytes == 577830912
    # total = reserved + free + used in the v2 struct: 577830912 + 149600665600 + 576323584
    assert reading.memory_total_bytes == 577830912 + 149600665600 + 576323584
    assert reading.pcie_tx_bytes_per_second == 1500 * 1024 == 1536000  # KB/s -> bytes/s
    assert reading.pcie_rx_bytes_per_second == 256000000
    assert reading.utilization_gpu_ratio == 0.37
    assert reading.link_findings() == []


def test_missing_values_are_none() -> None:
    reading = nvml.parse_device({"index": 3, "memory": None, "pcie_tx": None, "link_gen": "x"})
    assert reading.index == 3 and reading.memory_total_bytes is None
    assert reading.pcie_tx_bytes_per_second is None and reading.link_gen is None
    assert reading.pci_address is None and reading.link_findings() == []
    assert nvml.parse("") == [] and nvml.parse('{"devices": []}') == []


def test_link_findings() -> None:
    narrow = nvml.parse_device({**RAW, "link_width": 8, "link_gen": 1, "link_gen_max": 4})
    findings = narrow.link_findings()
    assert findings[0].startswith("GPU 0: PCIe link runs x8 of x16")
    assert "Gen1 of Gen4" in findings[1] and "normal while idle" in findings[1]
    assert "slot caps the link at Gen4; the GPU supports Gen5" in findings[2]
    assert nvml.normalize_bus_id("00000001:AB:00.0") == "0001:ab:00.0"


@pytest.mark.skipif(not GPU_DUMP.is_file(), reason="GPU machine capture not present")
def test_captured_gpu_dump() -> None:
    readings = nvml.parse(GPU_DUMP.read_text())
    assert readings, "the GPU machine's dump lists no device"
    for r in readings:
        assert r.pci_address is not None and r.memory_total_bytes
        assert r.memory_used_bytes is not None and r.memory_free_bytes is not None
        assert r.memory_used_bytes + r.memory_free_bytes <= r.memory_total_bytes
        if r.link_width is not None and r.link_width_max is not None:
            assert 1 <= r.link_width <= r.link_width_max
