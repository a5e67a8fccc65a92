"""The mlock rule L2 applies (and `kvtier doctor` reports): CAP_IPC_LOCK lifts RLIMIT_MEMLOCK.

The capability probe is replaced where a branch needs it; the limit is this process's real one,
lowered for the test and restored after.
"""

from __future__ import annotations

import resource
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvtier.errors import BudgetError
from kvtier.tiers import memlock
from kvtier.tiers.l2 import ALIGN, HostArena

LIMIT = 64 * 1024


@pytest.fixture
def low_limit() -> Iterator[int]:
    """This process's soft RLIMIT_MEMLOCK lowered to 64 KiB (the hard limit unchanged)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    resource.setrlimit(resource.RLIMIT_MEMLOCK, (LIMIT, hard))
    try:
        yield LIMIT
    finally:
        resource.setrlimit(resource.RLIMIT_MEMLOCK, (soft, hard))


def test_without_the_capability_the_real_limit_decides(
    low_limit: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(memlock, "has_cap_ipc_lock", lambda *a: False)
    assert memlock.soft_memlock() == low_limit
    ok, why = memlock.memlock_allows(1 << 20)
    assert not ok and why == f"mlock of {1 << 20} bytes exceeds RLIMIT_MEMLOCK ({low_limit} bytes)"
    ok, why = memlock.memlock_allows(low_limit)
    assert ok and "covers" in why
    # L2 refuses before mapping anything, naming the limit and how to raise it.
    with pytest.raises(BudgetError, match=r"exceeds RLIMIT_MEMLOCK.*LimitMEMLOCK"):
        HostArena(ALIGN, 1 << 20, pin=False, mlock=True)


def test_with_the_capability_the_limit_does_not_apply(
    low_limit: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    really = memlock.has_cap_ipc_lock()
    monkeypatch.setattr(memlock, "has_cap_ipc_lock", lambda *a: True)
    ok, why = memlock.memlock_allows(1 << 40)
    assert ok and "CAP_IPC_LOCK" in why
    if not really:
        pytest.skip("this process cannot lock beyond its limit, so L2 cannot be built here")
    # The kernel lets this process lock past the limit, and L2 does not refuse.
    with HostArena(ALIGN, 1 << 20, pin=False, mlock=True) as arena:
        assert arena.mlocked


def test_explicit_facts_and_unlimited() -> None:
    assert memlock.memlock_allows(1 << 40, soft_limit=-1, cap_ipc_lock=False) == (
        True,
        "RLIMIT_MEMLOCK is unlimited",
    )
    assert not memlock.memlock_allows(2, soft_limit=1, cap_ipc_lock=False)[0]
    assert memlock.memlock_allows(2, soft_limit=1, cap_ipc_lock=True)[0]


@pytest.mark.parametrize(
    ("capeff", "has"),
    [("0000000000004000", True), ("000001fffeffbfff", False), ("0000000000000000", False)],
)
def test_capability_probe_reads_capeff(tmp_path: Path, capeff: str, has: bool) -> None:
    status = tmp_path / "status"
    status.write_text(f"Name:\tpython\nCapPrm:\tffffffffffffffff\nCapEff:\t{capeff}\n")
    assert memlock.has_cap_ipc_lock(status) is has
    assert memlock.has_cap_ipc_lock(tmp_path / "missing") is False
