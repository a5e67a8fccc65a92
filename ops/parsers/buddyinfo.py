"""/proc/buddyinfo: free blocks per node, zone and order, and the fragmentation figures.

Line format (unchanged since 2.6): `Node 0, zone   Normal  6488  3005 ...`, one count of free
blocks of 2**order pages per order, order 0 first (11 orders on x86-64; other page sizes and
CONFIG_ARCH_FORCE_MAX_ORDER change the count, so it is read from the line).

The two indices follow the kernel's mm/vmstat.c (debugfs `extfrag/unusable_index` and
`extfrag/extfrag_index`) in its integer arithmetic, in thousandths, so they equal what debugfs
prints; docs/collectors.md gives the formulas.
"""

from __future__ import annotations

from dataclasses import dataclass

HUGE_2M = 2 * 1024 * 1024


@dataclass(frozen=True)
class Zone:
    """The free lists of one zone of one NUMA node."""

    node: int
    name: str
    free_blocks: tuple[int, ...]  # index = order; a block is 2**order pages
    page_size: int = 4096

    @property
    def free_pages(self) -> int:
        return sum(blocks << order for order, blocks in enumerate(self.free_blocks))

    @property
    def free_bytes(self) -> int:
        return self.free_pages * self.page_size

    @property
    def free_bytes_by_order(self) -> tuple[int, ...]:
        """Bytes held in free blocks of each order (blocks x 2**order pages x page size)."""
        return tuple(
            (blocks << order) * self.page_size for order, blocks in enumerate(self.free_blocks)
        )

    @property
    def largest_order(self) -> int | None:
        """Highest order with a free block; None when the zone has no free page at all."""
        orders = [order for order, blocks in enumerate(self.free_blocks) if blocks]
        return orders[-1] if orders else None

    def suitable_blocks(self, order: int) -> int:
        """Free blocks of size 2**order pages that higher orders hold (kernel: free_blocks_suitable)."""
        return sum(blocks << (o - order) for o, blocks in enumerate(self.free_blocks) if o >= order)

    def unusable_index_milli(self, order: int) -> int:
        """Share of free memory unusable for an order-`order` allocation, in thousandths.

        Kernel unusable_free_index(): 1000 when nothing is free, else
        (free_pages - (suitable << order)) * 1000 / free_pages, integer division.
        """
        free = self.free_pages
        if free == 0:
            return 1000
        return (free - (self.suitable_blocks(order) << order)) * 1000 // free

    def fragmentation_index_milli(self, order: int) -> int:
        """Kernel __fragmentation_index() in thousandths: near 0 means an order-`order`
        allocation would fail for lack of memory, near 1000 for fragmentation; -1000 means it
        would succeed (a suitable block exists); 0 when the zone has no free block.
        """
        total_blocks = sum(self.free_blocks)
        if total_blocks == 0:
            return 0
        if self.suitable_blocks(order):
            return -1000
        requested = 1 << order
        return 1000 - (1000 + self.free_pages * 1000 // requested) // total_blocks

    def unusable_index(self, order: int) -> float:
        return self.unusable_index_milli(order) / 1000

    def fragmentation_index(self, order: int) -> float:
        return self.fragmentation_index_milli(order) / 1000

    def huge_order(self, size: int = HUGE_2M) -> int:
        """The buddy order of a `size`-byte block (9 for 2 MiB with 4 KiB pages)."""
        return (size // self.page_size).bit_length() - 1

    def headroom_bytes(self, size: int = HUGE_2M) -> int:
        """Bytes available as naturally aligned `size` blocks (2 MiB: order-9 and larger)."""
        return self.suitable_blocks(self.huge_order(size)) * size


@dataclass(frozen=True)
class BuddyInfo:
    """Every zone in /proc/buddyinfo, in file order."""

    zones: tuple[Zone, ...]

    @property
    def free_bytes(self) -> int:
        return sum(zone.free_bytes for zone in self.zones)

    @property
    def largest_order(self) -> int | None:
        orders = [z.largest_order for z in self.zones if z.largest_order is not None]
        return max(orders) if orders else None

    def headroom_bytes(self, size: int = HUGE_2M) -> int:
        """Bytes available as 2 MiB blocks over all nodes and zones (hugepage/THP headroom)."""
        return sum(zone.headroom_bytes(size) for zone in self.zones)

    def zone(self, node: int, name: str) -> Zone | None:
        for zone in self.zones:
            if zone.node == node and zone.name == name:
                return zone
        return None


def parse(text: str, page_size: int = 4096) -> BuddyInfo:
    """Parse /proc/buddyinfo text; malformed lines are skipped, an empty text gives no zones."""
    zones: list[Zone] = []
    for line in text.splitlines():
        head, sep, counts = line.partition("zone")
        if not sep or not head.startswith("Node"):
            continue
        try:
            node = int(head[len("Node") :].strip().rstrip(","))
            fields = counts.split()
            name = fields[0]
            blocks = tuple(int(value) for value in fields[1:])
        except (ValueError, IndexError):
            continue
        zones.append(Zone(node=node, name=name, free_blocks=blocks, page_size=page_size))
    return BuddyInfo(zones=tuple(zones))
