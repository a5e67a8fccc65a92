"""buddyinfo parser and the kernel's extfrag formulas, on the captured devvm file."""

from __future__ import annotations

from pathlib import Path

import pytest

from ops.parsers import buddyinfo

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
DEVVM = FIXTURES / "devvm"


def _debugfs(name: str) -> dict[tuple[int, str], list[int]]:
    """The kernel's own index file (captured with a matching buddyinfo), in thousandths."""
    out = {}
    for line in (DEVVM / "debugfs" / "extfrag" / name).read_text().splitlines():
        head, _, values = line.partition("zone")
        fields = values.split()
        node = int(head.split()[1].rstrip(","))
        out[(node, fields[0])] = [round(float(v) * 1000) for v in fields[1:]]
    return out


@pytest.fixture(scope="module")
def info() -> buddyinfo.BuddyInfo:
    return buddyinfo.parse((DEVVM / "proc" / "buddyinfo").read_text(), page_size=4096)


def test_zones_and_counts(info: buddyinfo.BuddyInfo) -> None:
    assert [(z.node, z.name) for z in info.zones] == [(0, "DMA"), (0, "DMA32"), (0, "Normal")]
    normal = info.zone(0, "Normal")
    assert normal is not None
    assert normal.free_blocks == (5159, 1284, 209, 526, 279, 91, 42, 18, 10, 48, 153)


def test_free_pages_bytes_and_orders(info: buddyinfo.BuddyInfo) -> None:
    normal = info.zone(0, "Normal")
    assert normal is not None
    # 5159 + 1284*2 + 209*4 + 526*8 + 279*16 + 91*32 + 42*64 + 18*128 + 10*256 + 48*512
    # + 153*1024 = 5159 + 2568 + 836 + 4208 + 4464 + 2912 + 2688 + 2304 + 2560 + 24576 + 156672
    # = 208947 pages
    assert normal.free_pages == 208947
    assert normal.free_bytes == 208947 * 4096 == 855846912
    # order 10: 153 blocks x 1024 pages x 4096 bytes = 641,728,512
    assert normal.free_bytes_by_order[10] == 641728512
    assert normal.free_bytes_by_order[0] == 5159 * 4096
    assert normal.largest_order == 10
    # DMA: 1*256 + 1*512 + 3*1024 = 3840 pages
    dma = info.zone(0, "DMA")
    assert dma is not None and dma.free_pages == 3840
    # DMA32: 1 + 6 + 0 + 16 + 48 + 64 + 64 + 512 + 1024 + 1024 + 752*1024 (770048) = 772807
    dma32 = info.zone(0, "DMA32")
    assert dma32 is not None and dma32.free_pages == 772807
    assert info.free_bytes == (3840 + 772807 + 208947) * 4096
    assert info.largest_order == 10


def test_headroom_for_2mib(info: buddyinfo.BuddyInfo) -> None:
    normal = info.zone(0, "Normal")
    assert normal is not None
    assert normal.huge_order() == 9  # 2 MiB / 4 KiB = 512 pages = 2**9
    # order 9: 48 blocks, order 10: 153 blocks of two 2 MiB halves -> 48 + 306 = 354 blocks
    assert normal.suitable_blocks(9) == 354
    assert normal.headroom_bytes() == 354 * 2 * 1024 * 1024 == 742391808
    # DMA: 1 (order 9) + 3*2 (order 10) = 7; DMA32: 2 + 752*2 = 1506; total 7 + 1506 + 354
    assert info.headroom_bytes() == (7 + 1506 + 354) * 2097152


def test_unusable_index_by_hand(info: buddyinfo.BuddyInfo) -> None:
    normal = info.zone(0, "Normal")
    assert normal is not None
    # order 9: (208947 - 354 << 9) * 1000 // 208947 = (208947 - 181248) * 1000 // 208947
    #        = 27699000 // 208947 = 132
    assert normal.unusable_index_milli(9) == 132
    assert normal.unusable_index(9) == 0.132
    # order 10: (208947 - 153 * 1024) * 1000 // 208947 = 52275000 // 208947 = 250
    assert normal.unusable_index(10) == 0.25
    assert normal.unusable_index(0) == 0.0  # every free page serves an order-0 request


def test_indices_equal_the_kernels_debugfs(info: buddyinfo.BuddyInfo) -> None:
    unusable, extfrag = _debugfs("unusable_index"), _debugfs("extfrag_index")
    for zone in info.zones:
        orders = range(len(zone.free_blocks))
        assert [zone.unusable_index_milli(o) for o in orders] == unusable[(zone.node, zone.name)]
        assert [zone.fragmentation_index_milli(o) for o in orders] == extfrag[
            (zone.node, zone.name)
        ]


def test_fragmentation_index_when_a_request_would_fail() -> None:
    # A zone with free memory only in small blocks: 100 order-0 and 50 order-1 blocks.
    zone = buddyinfo.Zone(node=0, name="Normal", free_blocks=(100, 50, 0, 0))
    # order 2: no suitable block; free_pages = 100 + 100 = 200, blocks = 150, requested = 4
    # 1000 - (1000 + 200*1000 // 4) // 150 = 1000 - 51000 // 150 = 1000 - 340 = 660
    assert zone.fragmentation_index_milli(2) == 660
    assert zone.fragmentation_index(2) == 0.66
    assert zone.fragmentation_index(1) == -1.0  # a block exists: the request succeeds
    # unusable for order 2: (200 - 0) * 1000 // 200 = 1000
    assert zone.unusable_index(2) == 1.0
    empty = buddyinfo.Zone(node=0, name="Normal", free_blocks=(0, 0, 0))
    assert empty.unusable_index(0) == 1.0 and empty.fragmentation_index(1) == 0.0
    assert empty.largest_order is None


def test_empty_and_garbage_text() -> None:
    assert buddyinfo.parse("").zones == ()
    assert buddyinfo.parse("Node x, zone Normal 1 2\nnot a line\n").zones == ()
    assert buddyinfo.BuddyInfo(zones=()).largest_order is None
