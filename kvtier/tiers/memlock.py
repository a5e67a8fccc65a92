"""Whether this process may mlock a number of bytes: the rule L2 applies before it locks its slabs.

The kernel lets a process with CAP_IPC_LOCK lock memory beyond RLIMIT_MEMLOCK; without it the
soft limit must be unlimited or at least the size. L2 (`HostArena(mlock=True)`) and `kvtier
doctor` both ask `memlock_allows`, so the doctor never calls a limit critical that L2 ignores.
This module imports neither torch nor anything heavy, so a quick CLI can use it.
"""

from __future__ import annotations

import resource
from pathlib import Path

CAP_IPC_LOCK = 14  # linux/capability.h


def has_cap_ipc_lock(status: str | Path = "/proc/self/status") -> bool:
    """Whether this process may lock memory beyond RLIMIT_MEMLOCK (CAP_IPC_LOCK effective)."""
    try:
        for line in Path(status).read_text().splitlines():
            if line.startswith("CapEff:"):
                return bool(int(line.split()[1], 16) >> CAP_IPC_LOCK & 1)
    except (OSError, ValueError, IndexError):
        pass
    return False


def soft_memlock() -> int:
    """This process's soft RLIMIT_MEMLOCK in bytes; -1 when unlimited."""
    soft = resource.getrlimit(resource.RLIMIT_MEMLOCK)[0]
    return -1 if soft == resource.RLIM_INFINITY else soft


def memlock_allows(
    nbytes: int, *, soft_limit: int | None = None, cap_ipc_lock: bool | None = None
) -> tuple[bool, str]:
    """(may this process mlock `nbytes`, why), as one line.

    `soft_limit` (bytes, -1 for unlimited) and `cap_ipc_lock` default to this process's own.
    """
    if cap_ipc_lock is None:
        cap_ipc_lock = has_cap_ipc_lock()
    if cap_ipc_lock:
        return True, "the process has CAP_IPC_LOCK, so RLIMIT_MEMLOCK does not apply"
    soft = soft_memlock() if soft_limit is None else soft_limit
    if soft < 0 or soft == resource.RLIM_INFINITY:
        return True, "RLIMIT_MEMLOCK is unlimited"
    if soft >= nbytes:
        return True, f"RLIMIT_MEMLOCK ({soft} bytes) covers {nbytes} bytes"
    return False, f"mlock of {nbytes} bytes exceeds RLIMIT_MEMLOCK ({soft} bytes)"
