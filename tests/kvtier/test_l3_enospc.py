"""ENOSPC on a real, size-limited tmpfs: a put fails with StoreFullError, leaves no partial
file and no index row, and the store keeps serving reads."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest
from l3_helpers import FP, header, payload_for

from kvtier.errors import StoreFullError
from kvtier.tiers.l3 import L3Store


@pytest.fixture
def small_fs(tmp_path: Path):
    if os.geteuid() != 0:
        pytest.skip("mounting a size-limited tmpfs needs root")
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    res = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=8m,mode=0700", "tmpfs", str(mnt)],
        capture_output=True,
        text=True,
    )
    if res.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {res.stderr.strip()}")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


@pytest.mark.root
def test_full_filesystem(small_fs: Path) -> None:
    store = L3Store(small_fs / "l3")
    stored = []
    failed = None
    try:
        for _ in range(20):
            h = header(size=1_000_000)
            try:
                store.put(h, payload_for(h.key, h.payload_len))
            except StoreFullError as exc:
                failed = h.key
                assert "full" in str(exc)
                break
            stored.append(h.key)
        assert failed is not None, "8 MiB filesystem never filled up"
        assert len(stored) >= 3
        assert not store.contains(failed)
        assert not store.path(failed).exists()
        assert not list(store.root.rglob("*.tmp"))
        files = sorted(p.stem for p in store.root.rglob("*.kvbin"))
        assert files == sorted(k.hex() for k in stored)
        assert store.stats().full_errors == 1 and store.stats().chunks == len(stored)
        for key in stored:  # reads keep working on the full filesystem
            assert store.get_bytes(key, fingerprint=FP)[1] == payload_for(key, 1_000_000)
        batch = [header(size=700_000) for _ in range(4)]  # written in parallel, none fits
        with pytest.raises(StoreFullError):
            store.put_many([(b, payload_for(b.key, b.payload_len)) for b in batch])
        assert not any(store.contains(b.key) for b in batch)
        assert not list(store.root.rglob("*.tmp"))
        assert store.stats().chunks == len(stored)
        store.delete(stored[0])
        h = header(size=500_000)
        store.put(h, payload_for(h.key, h.payload_len))
        assert store.get_bytes(h.key, fingerprint=FP)[1] == payload_for(h.key, 500_000)
    finally:
        store.close()
