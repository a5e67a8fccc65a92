"""kvtier doctor's swap check (docs/security.md): swap on a disk would hold plaintext pages of
the server outside the encryption at rest, so it warns and says how to turn it off."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from ops import doctor

DEVVM = Path(__file__).resolve().parents[1] / "fixtures" / "doctor" / "devvm"
HEADER = "Filename\t\t\t\tType\t\tSize\t\tUsed\t\tPriority\n"


def swap_finding(tmp_path: Path, swaps: str | None) -> doctor.Finding:
    root = tmp_path / "host"
    shutil.copytree(DEVVM, root, symlinks=True)
    (root / "proc" / "swaps").unlink(missing_ok=True)
    if swaps is not None:
        (root / "proc" / "swaps").write_text(swaps)
    facts = doctor.collect(
        l3_root=None, l2_bytes=None, proc_root=str(root / "proc"), sys_root=str(root / "sys"),
        fs_root=str(root), memlock=-1,
    )  # fmt: skip
    return next(f for f in doctor.check(facts) if f.id == "swap")


@pytest.mark.parametrize(
    ("swaps", "severity", "observed"),
    [
        (HEADER + "/dev/dm-1  partition\t8388604\t0\t-2\n", "warning", "active: /dev/dm-1"),
        (HEADER + "/swapfile  file\t1048572\t0\t-3\n", "warning", "active: /swapfile"),
        (HEADER + "/dev/zram0  partition\t4194300\t0\t100\n", "info", "1 zram area(s) only"),
        (HEADER, "ok", "none"),
        (None, "info", "unknown"),
    ],
)
def test_swap_on_a_disk_warns_with_the_fix(
    tmp_path: Path, swaps: str | None, severity: str, observed: str
) -> None:
    found = swap_finding(tmp_path, swaps)
    assert found.severity == severity and found.observed.startswith(observed)
    if severity == "warning":
        assert "swapoff -a" in found.fix and "/etc/fstab" in found.fix
        assert doctor.exit_code([found]) == 1
