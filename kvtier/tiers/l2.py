"""L2: a host-memory arena of fixed, chunk-sized slots in slabs allocated once at start.

The slabs are anonymous mappings (optionally huge pages, from MAP_HUGETLB or a hugetlbfs mount)
made and populated at construction, optionally mlock'ed, and registered with CUDA as pinned
memory when CUDA is present, so a chunk moves between GPU and host in one DMA copy. Every slot
has the same size, so the arena cannot fragment; `alloc` returns None when it is full and the
caller decides what to evict.

Slots are 4096-byte aligned and a multiple of 4096 bytes long, so O_DIRECT reads and writes of
.kvbin payloads go straight into them. Budgets are checked before anything is mapped: too little
MemAvailable, RLIMIT_MEMLOCK (for mlock) or free huge pages (vm.nr_hugepages) fail the
constructor with a `BudgetError` that names the setting to raise.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import mmap
import os
import resource
import threading
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from kvtier.errors import BudgetError, ConfigError

ALIGN = 4096
DEFAULT_SLAB_BYTES = 1 << 30
HEADROOM_BYTES = 256 << 20  # RAM left for the rest of the process beyond the arena
_CAP_IPC_LOCK = 14
_MAP_HUGETLB = getattr(mmap, "MAP_HUGETLB", 0x40000)
_MAP_POPULATE = getattr(mmap, "MAP_POPULATE", 0x8000)
_MAP_FAILED = ctypes.c_void_p(-1).value

_libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [
    ctypes.c_void_p,
    ctypes.c_size_t,
    ctypes.c_int,
    ctypes.c_int,
    ctypes.c_int,
    ctypes.c_long,
]
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_libc.mlock.argtypes = [ctypes.c_void_p, ctypes.c_size_t]


@dataclass(frozen=True)
class ArenaStats:
    """Occupancy of the arena, for the cache's snapshot and for tests."""

    slot_bytes: int
    n_slots: int
    free_slots: int
    used_slots: int
    capacity_bytes: int
    used_bytes: int
    slabs: int
    pinned: bool
    hugepages: bool
    mlocked: bool


@dataclass
class _Slab:
    address: int
    nbytes: int
    tensor: torch.Tensor
    registered: bool = False


def _release_mapping(address: int, nbytes: int, fd: int | None) -> None:
    """Unmap a slab (which also unlocks it); runs once the last view of it is gone."""
    _libc.munmap(address, nbytes)
    if fd is not None:
        os.close(fd)


def meminfo(path: str = "/proc/meminfo") -> dict[str, int]:
    """/proc/meminfo as bytes (kB fields scaled; HugePages_* counts left as counts)."""
    out: dict[str, int] = {}
    try:
        text = Path(path).read_text()
    except OSError:
        return out
    for line in text.splitlines():
        name, _, rest = line.partition(":")
        fields = rest.split()
        if not fields:
            continue
        value = int(fields[0])
        out[name.strip()] = value * 1024 if fields[1:] == ["kB"] else value
    return out


def _has_cap_ipc_lock() -> bool:
    """Whether this process may lock memory beyond RLIMIT_MEMLOCK (CAP_IPC_LOCK effective)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("CapEff:"):
                return bool(int(line.split()[1], 16) >> _CAP_IPC_LOCK & 1)
    except (OSError, ValueError, IndexError):
        pass
    return False


def _cuda_register(address: int, nbytes: int) -> bool:
    """Pin an existing host range with cudaHostRegister; False when torch cannot do it."""
    cudart = torch.cuda.cudart()
    register = getattr(cudart, "cudaHostRegister", None)
    if register is None:
        return False
    err = register(address, nbytes, 0)
    if int(err) != 0:
        raise BudgetError(
            f"cudaHostRegister of {nbytes} bytes failed (cudaError {int(err)}); the driver could "
            "not pin that much host memory: lower the L2 size or free host RAM"
        )
    return True


def _cuda_unregister(address: int) -> None:
    cudart = torch.cuda.cudart()
    cudart.cudaHostUnregister(address)


class HostArena:
    """Fixed-size slots in host memory slabs, pinned when CUDA is present.

    `pin=None` pins iff CUDA is available. With `hugepages=True` slabs come from MAP_HUGETLB
    (or files in the hugetlbfs mount `hugetlbfs`); `mlock=True` locks them so they never swap.
    Pinning through the CUDA driver does not count against RLIMIT_MEMLOCK; mlock does, and is
    checked before anything is mapped.
    """

    def __init__(
        self,
        slot_bytes: int,
        total_bytes: int,
        *,
        pin: bool | None = None,
        hugepages: bool = False,
        mlock: bool = False,
        hugetlbfs: str | os.PathLike[str] | None = None,
        slab_bytes: int = DEFAULT_SLAB_BYTES,
    ) -> None:
        if slot_bytes <= 0:
            raise ConfigError(f"L2 slot size must be positive, got {slot_bytes} bytes")
        self.slot_bytes = -(-int(slot_bytes) // ALIGN) * ALIGN
        self.n_slots = int(total_bytes) // self.slot_bytes
        if self.n_slots < 1:
            raise ConfigError(
                f"L2 size {total_bytes} bytes holds no slot of {self.slot_bytes} bytes; raise "
                "l2_bytes to at least one chunk"
            )
        self.capacity_bytes = self.n_slots * self.slot_bytes
        self.pinned = torch.cuda.is_available() if pin is None else bool(pin)
        if self.pinned and not torch.cuda.is_available():
            raise ConfigError("pin=True needs CUDA; pass pin=None to pin only when CUDA exists")
        self.hugepages = bool(hugepages or hugetlbfs)
        self.mlocked = bool(mlock)
        self._hugetlbfs = Path(hugetlbfs) if hugetlbfs is not None else None
        self._page = self._huge_page_bytes() if self.hugepages else ALIGN
        per_slab = max(1, min(self.n_slots, int(slab_bytes) // self.slot_bytes))
        self._slots_per_slab = per_slab
        self._check_budget()

        self._lock = threading.Lock()
        self._free = list(range(self.n_slots - 1, -1, -1))  # pop() hands out slot 0 first
        self._in_use = bytearray(self.n_slots)
        self._slabs: list[_Slab] = []
        self._closed = False
        try:
            remaining = self.n_slots
            while remaining:
                count = min(per_slab, remaining)
                self._slabs.append(self._map_slab(count * self.slot_bytes))
                remaining -= count
        except BaseException:
            self.close()
            raise

    # ---- construction ------------------------------------------------------------------------

    def _huge_page_bytes(self) -> int:
        size = meminfo().get("Hugepagesize", 2 << 20)
        return size if size > 0 else 2 << 20

    def _check_budget(self) -> None:
        info = meminfo()
        need = self.capacity_bytes
        if self.hugepages:
            free_pages = info.get("HugePages_Free", 0)
            pages = -(-need // self._page)
            if free_pages < pages:
                raise BudgetError(
                    f"L2 needs {pages} huge pages of {self._page} bytes but {free_pages} are free: "
                    f"raise vm.nr_hugepages (sysctl -w vm.nr_hugepages={pages + info.get('HugePages_Total', 0) - free_pages}) "
                    "or start without hugepages"
                )
        else:
            available = info.get("MemAvailable")
            if available is not None and need + HEADROOM_BYTES > available:
                raise BudgetError(
                    f"L2 wants {need} bytes of host RAM but MemAvailable is {available} bytes "
                    f"(keeping {HEADROOM_BYTES} spare): lower l2_bytes or free host memory"
                )
        if self.mlocked and not _has_cap_ipc_lock():
            soft, _hard = resource.getrlimit(resource.RLIMIT_MEMLOCK)
            if soft != resource.RLIM_INFINITY and soft < need:
                raise BudgetError(
                    f"mlock of {need} bytes exceeds RLIMIT_MEMLOCK ({soft} bytes): raise it "
                    "(LimitMEMLOCK=infinity in the systemd unit, `memlock` in "
                    "/etc/security/limits.conf, or ulimit -l) or start without mlock"
                )

    def _map_slab(self, nbytes: int) -> _Slab:
        nbytes = -(-nbytes // self._page) * self._page
        prot = mmap.PROT_READ | mmap.PROT_WRITE
        fd: int | None = None
        if self._hugetlbfs is not None:
            fd = os.open(self._hugetlbfs, os.O_RDWR | os.O_TMPFILE, 0o600)
            os.ftruncate(fd, nbytes)
            flags = mmap.MAP_SHARED | _MAP_POPULATE
            address = _libc.mmap(None, nbytes, prot, flags, fd, 0)
        else:
            flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | _MAP_POPULATE
            if self.hugepages:
                flags |= _MAP_HUGETLB
            address = _libc.mmap(None, nbytes, prot, flags, -1, 0)
        if address is None or address == _MAP_FAILED:
            err = ctypes.get_errno()
            if fd is not None:
                os.close(fd)
            hint = "raise vm.nr_hugepages" if self.hugepages else "lower l2_bytes"
            raise BudgetError(
                f"mapping an L2 slab of {nbytes} bytes failed: {os.strerror(err)}; {hint}"
            )
        array = (ctypes.c_uint8 * nbytes).from_address(address)
        # Tensors made from `array` keep it alive; the mapping goes when the last of them does,
        # so a view that outlives close() never points at unmapped memory.
        weakref.finalize(array, _release_mapping, address, nbytes, fd)
        slab = _Slab(address, nbytes, torch.frombuffer(array, dtype=torch.uint8))
        del array
        try:
            if self.mlocked and _libc.mlock(address, nbytes) != 0:
                err = ctypes.get_errno()
                raise BudgetError(
                    f"mlock of an L2 slab of {nbytes} bytes failed: {os.strerror(err)}; raise "
                    "RLIMIT_MEMLOCK (LimitMEMLOCK=infinity) or start without mlock"
                )
            if self.pinned:
                slab.registered = _cuda_register(address, nbytes)
                if not slab.registered:
                    # This torch build cannot register foreign memory: use its pinned allocator.
                    slab.tensor = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        except BaseException:
            self._unmap(slab)
            raise
        return slab

    def _unmap(self, slab: _Slab) -> None:
        """Unpin a slab and drop the arena's reference; the mapping goes with its last view."""
        if slab.registered:
            _cuda_unregister(slab.address)
            slab.registered = False
        slab.tensor = torch.empty(0, dtype=torch.uint8)

    # ---- slots -------------------------------------------------------------------------------

    def alloc(self) -> int | None:
        """A free slot's number, or None when the arena is full (the caller evicts)."""
        with self._lock:
            if self._closed or not self._free:
                return None
            slot = self._free.pop()
            self._in_use[slot] = 1
            return slot

    def free(self, slot: int) -> None:
        """Return `slot` to the arena. Freeing a slot that is not allocated is a bug: it raises."""
        with self._lock:
            if not 0 <= slot < self.n_slots or not self._in_use[slot]:
                raise ConfigError(
                    f"L2 slot {slot} is not allocated (double free or a slot of another arena)"
                )
            self._in_use[slot] = 0
            self._free.append(slot)

    def view(self, slot: int) -> torch.Tensor:
        """The slot's memory as a uint8 tensor of `slot_bytes` (shares memory, no copy)."""
        if self._closed:
            raise ConfigError("the L2 arena is closed")
        if not 0 <= slot < self.n_slots:
            raise ConfigError(f"L2 slot {slot} is outside 0..{self.n_slots - 1}")
        slab, index = divmod(slot, self._slots_per_slab)
        start = index * self.slot_bytes
        return self._slabs[slab].tensor[start : start + self.slot_bytes]

    def buffer(self, slot: int) -> Any:
        """The slot as a writable buffer-protocol object (for os.preadv / O_DIRECT I/O)."""
        return self.view(slot).numpy()

    def address(self, slot: int) -> int:
        return int(self.view(slot).data_ptr())

    def is_allocated(self, slot: int) -> bool:
        return bool(self._in_use[slot])

    @property
    def free_slots(self) -> int:
        return len(self._free)

    @property
    def used_bytes(self) -> int:
        return (self.n_slots - len(self._free)) * self.slot_bytes

    def stats(self) -> ArenaStats:
        with self._lock:
            free = len(self._free)
        return ArenaStats(
            slot_bytes=self.slot_bytes,
            n_slots=self.n_slots,
            free_slots=free,
            used_slots=self.n_slots - free,
            capacity_bytes=self.capacity_bytes,
            used_bytes=(self.n_slots - free) * self.slot_bytes,
            slabs=len(self._slabs),
            pinned=self.pinned,
            hugepages=self.hugepages,
            mlocked=self.mlocked,
        )

    def close(self) -> None:
        """Unpin every slab and let it go. Safe to call twice.

        Memory is unmapped once no view of it is left; views kept past close() stay readable
        but are no longer pinned, so hand them back first.
        """
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._free.clear()
            slabs, self._slabs = self._slabs, []
        for slab in slabs:
            self._unmap(slab)

    def __enter__(self) -> HostArena:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
