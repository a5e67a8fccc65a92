"""The L2 host arena: real mappings, real limits, real O_DIRECT into slots."""

from __future__ import annotations

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
