"""Where an L3 store's files live: `<root>/{hot,cold}/<2 hex>/<key>.kvbin`, `<root>/quarantine/`.

Only the chunk key names files. The cold directory may be elsewhere (the cold root, see
l3_root.resolve_cold_root); the store sets it once the index said which one is in use.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

from kvtier import kvbin
from kvtier.tiers.l3.root import check_safe

TIERS = ("hot", "cold")


class Layout:
    """The directories of one store and the path of each chunk file in them."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.dirs = {"hot": root / "hot", "cold": root / "cold"}
        self.quarantine = root / "quarantine"

    def path(self, key: bytes, tier: str = "hot") -> Path:
        """Where the chunk `key` lives in `tier` (only the key names files)."""
        h = hex_key(key)
        return self.dirs[tier] / h[:2] / f"{h}.kvbin"

    def make_dirs(self) -> None:
        for d in (*self.dirs.values(), self.quarantine):
            d.mkdir(mode=0o700, parents=True, exist_ok=True)
            check_safe(d, writable=True)

    def sweep_temp_files(self) -> None:
        """Remove temp files a crashed writer left (we hold the writer lock, so none is live)."""
        for d in self.dirs.values():
            for sub in subdirs(d):
                for name in os.listdir(sub):
                    if name.endswith(".tmp"):
                        with contextlib.suppress(FileNotFoundError):
                            os.unlink(sub / name)


def hex_key(key: bytes) -> str:
    if len(key) != kvbin.KEY_SIZE:
        raise ValueError(f"chunk key must be {kvbin.KEY_SIZE} bytes, got {len(key)}")
    return bytes(key).hex()


def tier_of(path: Path) -> str:
    return "cold" if path.parent.parent.name == "cold" else "hot"


def subdirs(base: Path) -> list[Path]:
    try:
        names = os.listdir(base)
    except FileNotFoundError:
        return []
    return [base / n for n in sorted(names) if len(n) == 2 and (base / n).is_dir()]
