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

A slab's CUDA registration lives exactly as long as its mapping: both are released together,
unregister first, when the arena and the last view of the slab are gone (whichever goes last),
so a later mapping at the same address never meets a stale registration. A failed CUDA call's
error is consumed at once, so torch never raises it at an unrelated later operation, and a
failed registration fails the constructor with a `BudgetError` (no silent unpinned fallback).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import mmap
import os
import threading
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch

from kvtier.errors import BudgetError, ConfigError
from kvtier.tiers.libc import libc
from kvtier.tiers.memlock import memlock_allows

log = logging.getLogger(__name__)

ALIGN = 4096
DEFAULT_SLAB_BYTES = 1 << 30
HEADROOM_BYTES = 256 << 20  # RAM left for the rest of the process beyond the arena
_MAP_HUGETLB = getattr(mmap, "MAP_HUGETLB", 0x40000)
_MAP_POPULATE = getattr(mmap, "MAP_POPULATE", 0x8000)
_MAP_FAILED = ctypes.c_void_p(-1).value
_REGISTER_PORTABLE = 1  # cudaHostRegisterPortable: pinned for every CUDA context, not one
_CUDA_ERRORS = {
    2: "cudaErrorMemoryAllocation",
    712: "cudaErrorHostMemoryAlreadyRegistered",
    713: "cudaErrorHostMemoryNotRegistered",
}


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


class Runtime(Protocol):
    """The CUDA runtime calls the arena makes (torch's `torch.cuda.cudart()` bindings)."""

    def cudaHostRegister(self, ptr: int, size: int, flags: int) -> Any: ...

    def cudaHostUnregister(self, ptr: int) -> Any: ...


def _consume_cuda_error() -> None:
    """Reset the runtime's per-thread last error left by a failed call.

    torch's launch check reads (and clears) that error after every kernel launch and raises it,
    so a one-element launch takes it out of the way of the next unrelated torch operation.
    """
    try:
        torch.zeros(1, device="cuda")
    except RuntimeError:  # torch.AcceleratorError carrying the pending error: now consumed
        pass


class CudaHost:
    """Host-memory registration with CUDA; every failed call's error is consumed at once."""

    def __init__(self, runtime: Runtime, consume: Any = _consume_cuda_error) -> None:
        self._runtime = runtime
        self._consume = consume

    def register(self, address: int, nbytes: int) -> int:
        """cudaHostRegister (portable); the cudaError code, 0 on success."""
        err = int(self._runtime.cudaHostRegister(address, nbytes, _REGISTER_PORTABLE))
        if err:
            self._consume()
        return err

    def unregister(self, address: int) -> int:
        """cudaHostUnregister after the device is idle (no copy may still use the range)."""
        self.synchronize()
        err = int(self._runtime.cudaHostUnregister(address))
        if err:
            self._consume()
        return err

    def synchronize(self) -> None:
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            torch.cuda.synchronize()


def _cuda_host() -> CudaHost | None:
    """The registration interface, or None without CUDA (the arena then stays unpinned)."""
    if not torch.cuda.is_available():
        return None
    return CudaHost(torch.cuda.cudart())


def error_name(code: int) -> str:
    return _CUDA_ERRORS.get(code, f"cudaError {code}")


class _Mapping:
    """One slab's mapping and its CUDA registration, released together exactly once.

    `release` runs from a weakref finalizer of the buffer every view of the slab holds, so it
    runs when the arena and the last view are gone, whichever goes last, or at exit.
    """

    __slots__ = ("address", "fd", "host", "nbytes")

    def __init__(self, address: int, nbytes: int, fd: int | None) -> None:
        self.address = address
        self.nbytes = nbytes
        self.fd = fd
        self.host: CudaHost | None = None  # set once the range is registered

    def release(self) -> None:
        """Unregister (while still mapped), then unmap (which also unlocks) and close."""
        host, self.host = self.host, None
        if host is not None:
            try:
                err = host.unregister(self.address)
            except Exception as exc:  # at interpreter exit CUDA may be gone already
                log.warning("cudaHostUnregister of L2 slab 0x%x: %s", self.address, exc)
            else:
                if err:
                    log.warning(
                        "cudaHostUnregister of L2 slab 0x%x failed: %s",
                        self.address,
                        error_name(err),
                    )
        libc.munmap(self.address, self.nbytes)
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None


@dataclass
class _Slab:
    mapping: _Mapping
    tensor: torch.Tensor


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


class HostArena:
    """Fixed-size slots in host memory slabs, pinned when CUDA is present.

    `pin=None` pins iff CUDA is available. With `hugepages=True` slabs come from MAP_HUGETLB
    (or files in the hugetlbfs mount `hugetlbfs`); `mlock=True` locks them so they never swap.
    Pinning through the CUDA driver does not count against RLIMIT_MEMLOCK; mlock does, and is
    checked before anything is mapped. With `shared=True` each slab is a memfd (or hugetlbfs
    file) mapped MAP_SHARED, so another process can map the same pages from `slabs()`: the L3
    writer process writes chunks to disk straight from the slots.
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
        shared: bool = False,
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
        host = _cuda_host() if pin is None or pin else None
        self.pinned = host is not None if pin is None else bool(pin)
        if self.pinned and host is None:
            raise ConfigError("pin=True needs CUDA; pass pin=None to pin only when CUDA exists")
        self._host = host if self.pinned else None
        self.hugepages = bool(hugepages or hugetlbfs)
        self.mlocked = bool(mlock)
        self.shared = bool(shared or hugetlbfs)
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
        if self.mlocked:
            ok, why = memlock_allows(need)
            if not ok:
                raise BudgetError(
                    f"{why}: raise it "
                    "(LimitMEMLOCK=infinity in the systemd unit, `memlock` in "
                    "/etc/security/limits.conf, or ulimit -l) or start without mlock"
                )

    def _map_slab(self, nbytes: int) -> _Slab:
        nbytes = -(-nbytes // self._page) * self._page
        hint = "raise vm.nr_hugepages" if self.hugepages else "lower l2_bytes"
        fd: int | None = None
        try:  # the slab's file (shared) is closed on every way out but success
            fd = self._slab_file(nbytes, hint)
            address = self._mmap(nbytes, fd)
            if address is None or address == _MAP_FAILED:
                err = ctypes.get_errno()
                raise BudgetError(
                    f"mapping an L2 slab of {nbytes} bytes failed: {os.strerror(err)}; {hint}"
                )
        except BaseException:
            if fd is not None:
                os.close(fd)
            raise
        mapping = _Mapping(address, nbytes, fd)
        try:
            array = (ctypes.c_uint8 * nbytes).from_address(address)
            # Tensors made from `array` keep it alive; the mapping (and its registration) goes
            # when the last of them does, so a view that outlives close() never points at
            # unmapped or stale-registered memory.
            weakref.finalize(array, mapping.release)
        except BaseException:
            mapping.release()  # no finalizer owns it yet: unmap and close now
            raise
        slab = _Slab(mapping, torch.frombuffer(array, dtype=torch.uint8))
        del array
        try:
            if self.mlocked and libc.mlock(address, nbytes) != 0:
                err = ctypes.get_errno()
                raise BudgetError(
                    f"mlock of an L2 slab of {nbytes} bytes failed: {os.strerror(err)}; raise "
                    "RLIMIT_MEMLOCK (LimitMEMLOCK=infinity) or start without mlock"
                )
            if self._host is not None:
                self._register(mapping, self._host)
        except BaseException:
            slab.tensor = torch.empty(0, dtype=torch.uint8)  # unmaps it now (no view exists)
            raise
        return slab

    def _slab_file(self, nbytes: int, hint: str) -> int | None:
        """A file of `nbytes` for a shared slab (memfd or hugetlbfs), or None (anonymous)."""
        if self._hugetlbfs is None and not self.shared:
            return None
        if self._hugetlbfs is not None:
            fd = os.open(self._hugetlbfs, os.O_RDWR | os.O_TMPFILE, 0o600)
        else:
            huge = getattr(os, "MFD_HUGETLB", 4) if self.hugepages else 0
            fd = os.memfd_create("kvtier-l2", os.MFD_CLOEXEC | huge)
        try:
            os.ftruncate(fd, nbytes)
        except OSError as exc:
            os.close(fd)
            raise BudgetError(
                f"sizing the shared L2 slab file to {nbytes} bytes failed: {exc}; {hint}"
            ) from exc
        except BaseException:
            os.close(fd)
            raise
        return fd

    def _mmap(self, nbytes: int, fd: int | None) -> Any:
        """mmap a slab: of the file `fd` (MAP_SHARED), else anonymous (MAP_PRIVATE)."""
        prot = mmap.PROT_READ | mmap.PROT_WRITE
        if fd is not None:
            return libc.mmap(None, nbytes, prot, mmap.MAP_SHARED | _MAP_POPULATE, fd, 0)
        flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | _MAP_POPULATE
        if self.hugepages:
            flags |= _MAP_HUGETLB
        return libc.mmap(None, nbytes, prot, flags, -1, 0)

    def _register(self, mapping: _Mapping, host: CudaHost) -> None:
        """Pin the slab with cudaHostRegister, or fail with a BudgetError (never unpinned)."""
        err = host.register(mapping.address, mapping.nbytes)
        if err == 0:
            mapping.host = host
            return
        if err == 712:
            why = (
                "part of the range is already registered: memory pinned by other code in this "
                "process was unmapped without cudaHostUnregister"
            )
        else:
            why = "the driver could not pin that much host memory"
        raise BudgetError(
            f"cudaHostRegister of an L2 slab of {mapping.nbytes} bytes at 0x{mapping.address:x} "
            f"failed ({error_name(err)}): {why}; lower l2_bytes or free host RAM, or set "
            "pin_memory = false to run L2 unpinned (GPU copies then run at pageable speed)"
        )

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

    def locate(self, slot: int) -> tuple[int, int]:
        """(slab, byte offset in that slab) of `slot`: where another process finds it."""
        slab, index = divmod(slot, self._slots_per_slab)
        return slab, index * self.slot_bytes

    def slabs(self) -> list[tuple[int, int]]:
        """(file descriptor, bytes) of every slab of a shared arena, in slab order."""
        if not self.shared:
            raise ConfigError("this L2 arena is private; build it with shared=True")
        return [(s.mapping.fd, s.mapping.nbytes) for s in self._slabs]  # type: ignore[misc]

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
        """Let every slab go. Safe to call twice.

        A slab is unregistered from CUDA and unmapped once no view of it is left: at once when
        none is, else when the last view is dropped (views kept past close() stay readable and
        pinned until then).
        """
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._free.clear()
            slabs, self._slabs = self._slabs, []
        for slab in slabs:  # the last view of each releases it; usually that is this one
            slab.tensor = torch.empty(0, dtype=torch.uint8)

    def __enter__(self) -> HostArena:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
