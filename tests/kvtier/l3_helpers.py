"""Shared builders for the L3 tests (plain module: imported by test_l3*.py)."""

from __future__ import annotations

import hashlib
import os
import time

from kvtier.kvbin import ChunkHeader

FP = bytes(range(16))
OTHER_FP = bytes(range(1, 17))


def payload_for(key: bytes, size: int) -> bytes:
    """Deterministic payload of `size` bytes derived from the key (so readers can recheck it)."""
    block = hashlib.sha256(key).digest() * 128  # 4096 bytes
    return (block * (size // len(block) + 1))[:size]


def header(
    key: bytes | None = None, size: int = 10_000, tenant: str = "acme", **over: object
) -> ChunkHeader:
    fields: dict[str, object] = {
        "key": key or os.urandom(16),
        "parent": bytes(16),
        "fingerprint": FP,
        "tenant": tenant,
        "tokens": 7,
        "layers": 2,
        "kv_heads": 2,
        "head_dim": 8,
        "dtype": "bfloat16",
        "codec": "native",
        "codec_params": b"",
        "payload_len": size,
        "created": time.time(),
    }
    fields.update(over)
    return ChunkHeader(**fields)  # type: ignore[arg-type]
