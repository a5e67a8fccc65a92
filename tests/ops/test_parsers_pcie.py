"""PCIe placement from sysfs paths: path shapes of real machines (sources in the comments)."""

from __future__ import annotations

from ops.parsers import pcie

# Shape of an AMD desktop chipset tree (lspci -t posted in github.com/noonghunna/club-3090
# issue 851): root port 00:02.1 -> switch upstream port 04:00.0 -> downstream ports 05:xx.0.
NVME = (
    "/sys/devices/pci0000:00/0000:00:02.1/0000:04:00.0/0000:05:00.0/0000:06:00.0/nvme/nvme0/nvme0n1"
)
GPU_SWITCH = "/sys/devices/pci0000:00/0000:00:02.1/0000:04:00.0/0000:05:0c.0/0000:0f:00.0"
GPU_ROOT = "/sys/devices/pci0000:00/0000:00:01.1/0000:01:00.0"  # its own root port
# A second host bridge, as on the multi-root tree of issue 1322 ([0000:40] 07.1-[41]).
GPU_OTHER = "/sys/devices/pci0000:40/0000:40:07.1/0000:41:00.0"


def test_placement_reads_the_chain() -> None:
    at = pcie.placement(NVME)
    assert at.host_bridge == "pci0000:00"
    assert at.chain == ("0000:00:02.1", "0000:04:00.0", "0000:05:00.0", "0000:06:00.0")
    assert at.endpoint == "0000:06:00.0"
    virtual = pcie.placement("/sys/devices/virtual/block/dm-0")
    assert virtual.host_bridge is None and virtual.endpoint is None


def test_sharing_levels() -> None:
    nvme = pcie.placement(NVME)
    # common bridges 00:02.1 (root port) and 04:00.0 (switch upstream port): a shared switch
    assert pcie.sharing(pcie.placement(GPU_SWITCH), nvme) == pcie.Shared("switch", "0000:04:00.0")
    assert pcie.sharing(pcie.placement(GPU_ROOT), nvme) == pcie.Shared("host_bridge", "pci0000:00")
    assert pcie.sharing(pcie.placement(GPU_OTHER), nvme) == pcie.Shared("none", None)
    # Two functions behind one root port with no switch between (a bifurcated slot shape).
    a = pcie.placement("/sys/devices/pci0000:00/0000:00:03.1/0000:02:00.0")
    b = pcie.placement("/sys/devices/pci0000:00/0000:00:03.1/0000:02:00.1")
    assert pcie.sharing(a, b) == pcie.Shared("root_port", "0000:00:03.1")


def test_describe_names_what_to_do() -> None:
    text = pcie.describe("switch", "0000:0f:00.0", "0000:06:00.0", "0000:04:00.0")
    assert "share PCIe switch port 0000:04:00.0" in text and "IOWriteBandwidthMax" in text
    assert "no PCIe path" in pcie.describe("none", "a", "b", None)
