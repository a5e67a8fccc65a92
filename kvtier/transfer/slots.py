"""The order of the two movers' work on each L2 slot.

A slot is touched by the device mover (a copy down into it, or up out of it) and by the disk
mover (an L3 write reading it, an L3 read filling it), and neither may run over the other: a
device copy on a slot first settles the L3 I/O on it (a restore waits for the slot's L3 read
just before that chunk's copy, and a failed read raises there), and an L3 job first waits for
the device copy still using its slot. `SlotOrder` is where each mover records what it started
on a slot and finds what the other started; the movers share it and the totals
(kvtier.transfer.accounting), nothing else.

Each mover writes its own half (the device copies, the L3 I/O) from the threads that issue its
work; single dict operations, as the movers' own maps were.
"""

from __future__ import annotations

from concurrent.futures import Future
from typing import Any

from kvtier.transfer.staging import Handle


class SlotOrder:
    """Per L2 slot: the last device copy issued on it and the last L3 I/O (see the module
    docstring)."""

    def __init__(self) -> None:
        self._copies: dict[int, Handle] = {}  # slot -> last device copy touching it
        self._io: dict[int, tuple[Future[Any], bool]] = {}  # slot -> last L3 I/O, is a read

    # -- device copies (the device mover's) -----------------------------------------------------

    def copied(self, slot: int, handle: Handle) -> None:
        """`handle` is the last device copy on `slot`."""
        self._copies[slot] = handle

    def last_copy(self, slot: int) -> Handle | None:
        """The last device copy issued on `slot`, if it is still tracked."""
        return self._copies.get(slot)

    def _copy_busy(self, slot: int) -> bool:
        """Whether a device copy on `slot` may still be running."""
        copy = self._copies.get(slot)
        return copy is not None and not copy.done()

    def _forget_copy(self, slot: int) -> None:
        """Wait for the last device copy on `slot`, then drop its tracking."""
        copy = self._copies.pop(slot, None)
        if copy is not None:
            copy.wait()

    def take_copies(self) -> dict[int, Handle]:
        """Every slot's last device copy, forgotten here (the device mover goes)."""
        copies, self._copies = self._copies, {}
        return copies

    # -- L3 I/O (the disk mover's) --------------------------------------------------------------

    def started_io(self, slot: int, future: Future[Any], is_read: bool) -> None:
        """`future` is the last L3 I/O on `slot` (a read filling it, or a write reading it)."""
        self._io[slot] = (future, is_read)

    def settle_io(self, slot: int, strict: bool = False) -> None:
        """Wait for L3 I/O on `slot` before a device copy touches it.

        A failed write stays with its future. A failed read leaves the slot's bytes unusable:
        with `strict` (a copy about to read the slot) its error is raised here, and a write
        still in flight is left running (it only reads the slot too, so a restore need not
        wait for the disk).
        """
        entry = self._io.get(slot)
        if entry is None:
            return
        future, is_read = entry
        if strict and not is_read and not future.done():
            return
        self._io.pop(slot, None)
        error = future.exception()
        if strict and is_read and error is not None:
            raise error

    def _io_busy(self, slot: int) -> bool:
        """Whether L3 I/O on `slot` may still be running."""
        io = self._io.get(slot)
        return io is not None and not io[0].done()

    # -- both ------------------------------------------------------------------------------------

    def busy(self, slot: int) -> bool:
        """Whether a device copy or L3 I/O on `slot` may still be running."""
        return self._copy_busy(slot) or self._io_busy(slot)

    def forget(self, slot: int) -> None:
        """Wait for everything on `slot`, then drop its tracking (before the slot is freed)."""
        self._forget_copy(slot)
        self.settle_io(slot)

    def clear(self) -> None:
        """Forget every slot's copy and I/O (the engine closed)."""
        self._copies.clear()
        self._io.clear()
