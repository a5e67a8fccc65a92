"""Small shared value types: tiers, session states, chunk keys."""

from __future__ import annotations

import enum

# The cache's codecs for L2/L3 (the kvbin header's codec ids, in this order) and its L3 write
# policies: the names every entry point accepts (serve's --codec and --write-policy, CacheConfig)
CODECS: tuple[str, ...] = ("native", "int8", "fp8")
WRITE_POLICIES: tuple[str, ...] = ("write_through", "write_through_selective", "write_back")


class Tier(str, enum.Enum):
    """Where a chunk lives. The string value is the `tier` metric label."""

    L1 = "l1"
    L2 = "l2"
    L3 = "l3"
    L4 = "l4"  # the shared tier (Redis)


class SessionState(str, enum.Enum):
    ACTIVE = "active"  # a request is running on it now
    IDLE = "idle"  # KV in L1, no request running
    HIBERNATED = "hibernated"  # KV pushed down to L2/L3, L1 freed
    CLOSED = "closed"


class RestoreSource(str, enum.Enum):
    """Where the tokens of a restore came from (the `src` label of restore metrics)."""

    L1 = "l1"
    L2 = "l2"
    L3 = "l3"
    L4 = "l4"
    RECOMPUTE = "recompute"


KEY_BYTES = 16  # chunk keys are 128-bit digests


def key_hex(key: bytes) -> str:
    """Chunk keys print and name files as 32 lowercase hex digits."""
    if len(key) != KEY_BYTES:
        raise ValueError(f"chunk key must be {KEY_BYTES} bytes, got {len(key)}")
    return key.hex()
