"""The L2 host arena: real mappings, real limits, real O_DIRECT into slots."""

from __future__ import annotations

import ctypes
import gc
import os
import shutil
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch

from kvtier.errors import BudgetError, ConfigError
from kvtier.tiers.l2 import ALIGN, HostArena, meminfo


def test_slots_are_aligned_rounded_and_disjoint() -> None:
    with HostArena(10_000, 10 * 12288, pin=False) as arena:
        assert arena.slot_bytes == 12288 and arena.slot_bytes % ALIGN == 0
        assert arena.n_slots == 10 and arena.free_slots == 10
        slots = [arena.alloc() for _ in range(10)]
        assert sorted(s for s in slots if s is not None) == list(range(10))
        assert arena.alloc() is None  # full: the caller decides what to evict
        for slot in range(10):
            assert arena.address(slot) % ALIGN == 0
            assert arena.view(slot).numel() == 12288
            arena.view(slot).fill_(slot)
        for slot in range(10):
            assert int(arena.view(slot).min()) == int(arena.view(slot).max()) == slot
        st = arena.stats()
        assert (st.used_slots, st.free_slots, st.used_bytes) == (10, 0, 10 * 12288)
        arena.free(3)
        assert arena.alloc() == 3


def test_many_slabs() -> None:
    with HostArena(ALIGN, 10 * ALIGN, pin=False, slab_bytes=3 * ALIGN) as arena:
        assert arena.stats().slabs == 4
        addresses = {arena.address(s) for s in range(10)}
        assert len(addresses) == 10
        for slot in range(10):
            arena.view(slot)[:] = slot
        assert [int(arena.view(s)[-1]) for s in range(10)] == list(range(10))


def test_double_free_and_bad_slots_raise() -> None:
    with HostArena(ALIGN, 2 * ALIGN, pin=False) as arena:
        slot = arena.alloc()
        assert slot is not None
        arena.free(slot)
        with pytest.raises(ConfigError, match="double free"):
            arena.free(slot)
        with pytest.raises(ConfigError, match="outside"):
            arena.view(7)


def test_bad_sizes_raise_config_error() -> None:
    with pytest.raises(ConfigError, match="no slot"):
        HostArena(ALIGN * 4, ALIGN, pin=False)
    with pytest.raises(ConfigError, match="positive"):
        HostArena(0, ALIGN, pin=False)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only behaviour")
def test_pin_needs_cuda() -> None:
    with pytest.raises(ConfigError, match="CUDA"):
        HostArena(ALIGN, ALIGN, pin=True)
    with HostArena(ALIGN, ALIGN) as arena:  # pin=None: ordinary memory without CUDA
        assert not arena.stats().pinned


def test_more_than_available_ram_fails_before_mapping() -> None:
    available = meminfo()["MemAvailable"]
    with pytest.raises(BudgetError, match="MemAvailable"):
        HostArena(1 << 20, available + (1 << 30), pin=False)


def test_hugepages_without_a_pool_name_the_sysctl() -> None:
    if meminfo().get("HugePages_Free", 0) >= 8:
        pytest.skip("this host has huge pages reserved; the shortage path cannot be shown")
    with pytest.raises(BudgetError, match=r"vm\.nr_hugepages"):
        HostArena(2 << 20, 8 << 20, pin=False, hugepages=True)


def test_hugepages_when_reserved() -> None:
    if meminfo().get("HugePages_Free", 0) < 2:
        pytest.skip("no free huge pages (vm.nr_hugepages) on this host")
    with HostArena(2 << 20, 2 << 20, pin=False, hugepages=True) as arena:
        arena.view(0).fill_(1)
        assert int(arena.view(0).sum()) == 2 << 20


def test_mlock_locks_the_slabs() -> None:
    def locked() -> int:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmLck:"):
                return int(line.split()[1]) * 1024
        raise AssertionError("no VmLck in /proc/self/status")

    before = locked()
    arena = HostArena(ALIGN, 64 * ALIGN, pin=False, mlock=True)
    assert locked() - before >= 64 * ALIGN
    arena.close()
    arena.close()  # idempotent
    assert locked() == before


@pytest.mark.skipif(shutil.which("setpriv") is None, reason="needs util-linux setpriv")
def test_mlock_over_rlimit_memlock_names_the_limit() -> None:
    code = (
        "import resource\n"
        "resource.setrlimit(resource.RLIMIT_MEMLOCK, (65536, 65536))\n"
        "from kvtier.errors import BudgetError\n"
        "from kvtier.tiers.l2 import HostArena\n"
        "try:\n"
        "    HostArena(4096, 1 << 20, pin=False, mlock=True)\n"
        "except BudgetError as exc:\n"
        "    print('BudgetError', exc)\n"
    )
    # Without CAP_IPC_LOCK (root has it) the limit applies; drop it for the child.
    cmd = [sys.executable, "-c", code]
    if os.geteuid() == 0:
        cmd = ["setpriv", "--inh-caps=-ipc_lock", "--bounding-set=-ipc_lock", *cmd]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True, cwd=os.getcwd())
    assert out.stdout.startswith("BudgetError"), out.stdout + out.stderr
    assert "RLIMIT_MEMLOCK" in out.stdout and "LimitMEMLOCK" in out.stdout


def test_concurrent_alloc_free_hands_out_each_slot_once() -> None:
    with HostArena(ALIGN, 64 * ALIGN, pin=False) as arena:
        owners: dict[int, int] = {}
        lock = threading.Lock()
        errors: list[str] = []

        def work(me: int) -> None:
            for _ in range(2000):
                slot = arena.alloc()
                if slot is None:
                    continue
                with lock:
                    if slot in owners:
                        errors.append(f"slot {slot} held twice")
                    owners[slot] = me
                with lock:
                    del owners[slot]
                arena.free(slot)

        threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert not errors and arena.free_slots == 64


def test_views_outlive_close_safely() -> None:
    arena = HostArena(ALIGN, 2 * ALIGN, pin=False)
    view = arena.view(1)
    view.fill_(9)
    arena.close()
    assert arena.alloc() is None
    assert int(view.sum()) == 9 * ALIGN  # still mapped: the view holds the slab
    with pytest.raises(ConfigError, match="closed"):
        arena.view(0)


def test_o_direct_round_trip_through_slots(tmp_path: Path) -> None:
    path = tmp_path / "chunk.bin"
    with HostArena(3 * ALIGN, 2 * ALIGN * 3, pin=False) as arena:
        src, dst = arena.alloc(), arena.alloc()
        assert src is not None and dst is not None
        pattern = torch.arange(arena.slot_bytes, dtype=torch.int64).remainder(251).to(torch.uint8)
        arena.view(src).copy_(pattern)
        try:
            fd = os.open(path, os.O_CREAT | os.O_WRONLY | os.O_DIRECT, 0o600)
        except OSError as exc:
            pytest.skip(f"filesystem under tmp_path refuses O_DIRECT: {exc}")
        try:
            assert os.pwritev(fd, [arena.buffer(src)], 0) == arena.slot_bytes
        finally:
            os.close(fd)
        fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
        try:
            assert os.preadv(fd, [arena.buffer(dst)], 0) == arena.slot_bytes
        finally:
            os.close(fd)
        assert torch.equal(arena.view(dst), pattern)


# ---- CUDA registration lifecycle ------------------------------------------------------------


def _mapped(address: int, nbytes: int) -> bool:
    """Whether [address, address + nbytes) is mapped in this process (/proc/self/maps)."""
    for line in Path("/proc/self/maps").read_text().splitlines():
        start, _, end = line.split()[0].partition("-")
        if int(start, 16) <= address and address + nbytes <= int(end, 16):
            return True
    return False


class _Runtime:
    """cudaHostRegister/Unregister as the CUDA runtime behaves, for a CPU-only machine.

    A range overlapping a registered one is refused (712, cudaErrorHostMemoryAlreadyRegistered,
    what the H200 run hit), so is an unknown address (713); a failed call leaves `last_error`
    set, as the runtime's per-thread last error, until `consume` is called. Every call is logged
    with whether its range was mapped at that moment.
    """

    def __init__(self, fail_at: int | None = None) -> None:
        self.ranges: dict[int, int] = {}
        self.calls: list[tuple[str, int, bool]] = []
        self.last_error = 0
        self.fail_at = fail_at  # the n-th register fails with cudaErrorMemoryAllocation
        self.attempts = 0

    def cudaHostRegister(self, ptr: int, size: int, flags: int) -> int:
        self.attempts += 1
        if self.fail_at == self.attempts:
            err = 2
        elif any(ptr < a + n and a < ptr + size for a, n in self.ranges.items()):
            err = 712
        else:
            self.ranges[ptr] = size
            self.calls.append(("register", ptr, _mapped(ptr, size)))
            return 0
        self.calls.append(("refused", ptr, _mapped(ptr, size)))
        self.last_error = err
        return err

    def cudaHostUnregister(self, ptr: int) -> int:
        size = self.ranges.pop(ptr, None)
        self.calls.append(("unregister", ptr, size is not None and _mapped(ptr, size)))
        if size is None:
            self.last_error = 713
            return 713
        return 0

    def consume(self) -> None:
        self.last_error = 0

    def check_paired(self) -> None:
        """Each registered range was unregistered exactly once, while still mapped."""
        live: set[int] = set()
        for call, address, mapped in self.calls:
            assert mapped, f"{call} of 0x{address:x} after it was unmapped"
            if call == "register":
                live.add(address)
            elif call == "unregister":
                assert address in live, f"0x{address:x} unregistered twice or never registered"
                live.remove(address)
        assert not live
        assert not self.ranges and self.last_error == 0


@pytest.fixture
def runtime(monkeypatch: pytest.MonkeyPatch) -> _Runtime:
    """Arenas made in the test register through `_Runtime` (pin=None pins)."""
    from kvtier.tiers import l2

    rt = _Runtime()
    monkeypatch.setattr(l2, "_cuda_host", lambda: l2.CudaHost(rt, rt.consume))
    return rt


def _slabs(arena: HostArena) -> list[tuple[int, int]]:
    per = arena.n_slots // arena.stats().slabs
    return [(arena.address(s), per * arena.slot_bytes) for s in range(0, arena.n_slots, per)]


def test_close_unregisters_each_slab_once_before_unmapping(runtime: _Runtime) -> None:
    arena = HostArena(ALIGN, 6 * ALIGN, slab_bytes=2 * ALIGN)
    assert arena.stats().pinned and len(runtime.ranges) == 3
    slabs = _slabs(arena)
    arena.close()
    arena.close()
    runtime.check_paired()
    assert not any(_mapped(a, n) for a, n in slabs)


def test_a_view_past_close_keeps_its_slab_until_it_goes(runtime: _Runtime) -> None:
    arena = HostArena(ALIGN, 6 * ALIGN, slab_bytes=2 * ALIGN)
    slabs = _slabs(arena)
    view = arena.view(3)  # in the second slab
    arena.close()
    assert list(runtime.ranges) == [slabs[1][0]]  # still pinned and mapped for the view
    view.fill_(5)
    assert int(view.sum()) == 5 * ALIGN
    del view
    gc.collect()
    runtime.check_paired()
    assert not _mapped(*slabs[1])


def test_an_arena_dropped_without_close_frees_its_address_for_the_next(runtime: _Runtime) -> None:
    first = HostArena(1 << 20, 4 << 20)
    address = first.address(0)
    buffer = first.buffer(2)  # a numpy view outliving the arena object
    del first
    gc.collect()
    assert len(runtime.ranges) == 1
    del buffer
    gc.collect()
    assert not runtime.ranges
    again = HostArena(1 << 20, 4 << 20)  # the kernel hands the same address out again
    assert again.address(0) == address, "mmap did not reuse the address; the case is not shown"
    other = HostArena(1 << 20, 4 << 20)  # a second arena beside it
    assert len(runtime.ranges) == 2
    again.view(0).fill_(1)
    other.view(0).fill_(2)
    assert int(again.view(0)[0]) == 1 and int(other.view(0)[0]) == 2
    again.close()
    other.close()
    runtime.check_paired()


def test_a_failed_register_raises_budget_error_and_consumes_the_error(
    runtime: _Runtime,
) -> None:
    runtime.fail_at = 2  # the second slab
    with pytest.raises(BudgetError, match=r"cudaErrorMemoryAllocation.*pin_memory = false"):
        HostArena(ALIGN, 6 * ALIGN, slab_bytes=2 * ALIGN)
    assert runtime.last_error == 0  # nothing left for torch to raise later
    registered = [a for call, a, _ in runtime.calls if call != "unregister"]
    assert [call for call, _, _ in runtime.calls[:2]] == ["register", "refused"]
    gc.collect()
    assert not runtime.ranges  # the first slab was unregistered, then unmapped
    assert not any(_mapped(a, ALIGN) for a in registered)


def test_a_range_registered_elsewhere_is_a_budget_error(runtime: _Runtime) -> None:
    runtime.ranges[0] = 1 << 62  # every address: as if leaked by other code in the process
    with pytest.raises(BudgetError, match="already registered"):
        HostArena(ALIGN, 2 * ALIGN)
    assert runtime.last_error == 0 and list(runtime.ranges) == [0]


needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.mark.gpu
@needs_cuda
def test_cuda_arenas_come_and_go_at_the_same_address() -> None:
    from kvtier.tiers import l2

    device = torch.arange(1 << 20, device="cuda").to(torch.uint8)
    for round_ in range(4):
        arena = HostArena(1 << 20, 8 << 20)
        view = arena.view(3)
        if round_ % 2:  # closed with a live view, or just dropped
            arena.close()
        view.copy_(device, non_blocking=True)
        torch.cuda.synchronize()
        assert torch.equal(view, device.cpu())
        del arena, view
        gc.collect()
    a, b = HostArena(1 << 20, 4 << 20), HostArena(1 << 20, 4 << 20)
    host = l2._cuda_host()
    assert host is not None
    assert host.register(a.address(0), 1 << 20) == 712  # already registered: refused
    torch.randn(8, device="cuda").sum().item()  # its error did not leak into torch
    b.view(1).copy_(device, non_blocking=True)
    torch.cuda.synchronize()
    assert torch.equal(b.view(1), device.cpu())
    a.close()
    b.close()


def _open_fds() -> set[str]:
    gc.collect()  # a slab dropped by a failed constructor is released by its finalizer
    return set(os.listdir("/proc/self/fd"))


@pytest.mark.skipif(not hasattr(os, "memfd_create"), reason="shared slabs need memfd_create")
@pytest.mark.parametrize("fail_at", [1, 2])  # the first slab's ftruncate, or the second's
def test_a_failed_ftruncate_closes_the_shared_slab_file(
    monkeypatch: pytest.MonkeyPatch, fail_at: int
) -> None:
    real = os.ftruncate
    calls = []

    def ftruncate(fd: int, size: int) -> None:
        calls.append(fd)
        if len(calls) == fail_at:
            raise OSError(28, "No space left on device")
        real(fd, size)

    HostArena(ALIGN, 4 * ALIGN, pin=False, shared=True, slab_bytes=2 * ALIGN).close()  # warm up
    before = _open_fds()
    monkeypatch.setattr(os, "ftruncate", ftruncate)
    for _ in range(3):
        calls.clear()
        with pytest.raises(BudgetError, match=r"sizing the shared L2 slab file.*lower l2_bytes"):
            HostArena(ALIGN, 4 * ALIGN, pin=False, shared=True, slab_bytes=2 * ALIGN)
        assert len(calls) == fail_at
    assert _open_fds() == before  # neither the failed slab's memfd nor an earlier slab's


@pytest.mark.skipif(not hasattr(os, "memfd_create"), reason="shared slabs need memfd_create")
def test_a_failed_shared_mmap_closes_the_slab_file(monkeypatch: pytest.MonkeyPatch) -> None:
    from kvtier.tiers import l2

    real = l2.libc

    class Libc:  # the real libc, but mmap of a shared slab raises as a bad ctypes call would
        def __getattr__(self, name: str) -> object:
            return getattr(real, name)

        def mmap(self, *args: object) -> int:
            raise ctypes.ArgumentError("argument 5: wrong type")

    HostArena(ALIGN, 4 * ALIGN, pin=False, shared=True).close()
    before = _open_fds()
    monkeypatch.setattr(l2, "libc", Libc())
    with pytest.raises(ctypes.ArgumentError):
        HostArena(ALIGN, 4 * ALIGN, pin=False, shared=True)
    assert _open_fds() == before
