"""kvtier doctor on captured /proc and /sys trees (tests/fixtures/doctor/devvm, gpu-h200).

Each test copies a captured tree, changes the one file a scenario is about, collects the facts
from it with a real L3 directory, and checks the findings; a last test runs the command live.
"""

from __future__ import annotations

import dataclasses
import json
import os
import pwd
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from ops import doctor, tuning
from ops.collectors import disk
from ops.commands.doctor import command

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
DEVVM = FIXTURES / "doctor" / "devvm"
H200 = FIXTURES / "gpu-h200"
GIB = tuning.GIB
H200_GPU = "devices/pci0000:00/0000:00:06.0"


@pytest.fixture
def host(tmp_path: Path) -> Path:
    """A writable copy of the captured devvm tree (proc/, sys/) plus an fs root and an L3 dir."""
    root = tmp_path / "host"
    shutil.copytree(DEVVM, root, symlinks=True)
    (root / "l3").mkdir(mode=0o700)
    os.chmod(root / "l3", 0o700)
    return root


def _vda(sys_root: Path) -> disk.BlockDevice:
    device = disk.block_device(254, 0, sys_root=str(sys_root))
    assert device is not None and device.name == "vda"
    return device


def _facts(root: Path, *, l2: int | None = 2 * GIB, memlock: int = -1, **kw) -> doctor.Facts:
    sys_root = Path(kw.pop("sys_root", root / "sys"))
    return doctor.collect(
        l3_root=str(kw.pop("l3_root", root / "l3")),
        l2_bytes=l2,
        proc_root=str(root / "proc"),
        sys_root=str(sys_root),
        fs_root=str(kw.pop("fs_root", root)),
        owner=pwd.getpwuid(os.geteuid()).pw_name,
        memlock=memlock,
        device=kw.pop("device", None) or _vda(sys_root),
    )


def _by_id(facts: doctor.Facts) -> dict[str, doctor.Finding]:
    return {f.id: f for f in doctor.check(facts)}


def test_captured_devvm(host: Path) -> None:
    found = _by_id(_facts(host))
    # The capture holds the kernel defaults: 100 / 20 / 10, no huge pages, THP madvise.
    assert (
        found["sysctl.vfs_cache_pressure"].severity,
        found["sysctl.vfs_cache_pressure"].observed,
    ) == ("warning", "100")
    assert found["sysctl.vfs_cache_pressure"].recommended == "50"
    assert "kvtier_host_vfs_cache_pressure: 50" in found["sysctl.vfs_cache_pressure"].fix
    assert (found["sysctl.dirty_ratio"].severity, found["sysctl.dirty_ratio"].observed) == (
        "warning",
        "20",
    )
    assert found["sysctl.dirty_background_ratio"].observed == "10"
    assert (found["hugepages"].severity, found["hugepages"].observed) == ("warning", "0 x 2048 KiB")
    assert found["hugepages"].recommended == ">= 1024 x 2048 KiB"
    assert found["thp"].severity == "ok" and found["thp"].observed == "madvise"
    assert found["memlock"].severity == "ok"  # unlimited
    assert (
        found["l3.filesystem"].severity == "ok" and found["l3.filesystem"].observed == "ext4 at /"
    )
    assert found["l3.o_direct"].observed == "ok"  # a real probe in a real directory
    assert found["l3.mode"].severity == "ok" and found["l3.mode"].observed == "0700"
    assert found["l3.owner"].severity == "ok"
    assert (
        found["l3.scheduler"].severity == "info"
        and found["l3.scheduler"].observed == "vda is not NVMe"
    )
    assert found["pcie.shared"].observed == "no GPU found"
    assert "fstrim" in found and found["fstrim"].observed == "absent"
    assert doctor.exit_code(list(found.values())) == 1
    for f in found.values():
        assert f.severity in doctor.SEVERITIES and f.why and f.fix


def test_tuned_host_is_healthy(host: Path) -> None:
    vm = host / "proc/sys/vm"
    for name, value in tuning.sysctl_values(2 * GIB).items():
        (vm / name.removeprefix("vm.")).write_text(f"{value}\n")
    meminfo = (host / "proc/meminfo").read_text()
    (host / "proc/meminfo").write_text(
        meminfo.replace("HugePages_Total:       0", "HugePages_Total:    1024")
    )
    with open(host / "proc/self/mountinfo", "a") as f:
        f.write(
            "50 24 0:50 / /var/lib/kvtier/hugepages rw,relatime - hugetlbfs hugetlbfs rw,pagesize=2M\n"
        )
    _fstrim(host, "offpeak")
    facts = _facts(host)
    # free space is the one fact read from the real filesystem under the temp dir; this test is
    # about a tuned host, so give it a healthy disk whatever the machine running the test has
    facts = dataclasses.replace(
        facts, l3=dataclasses.replace(facts.l3, free_bytes=800 * GIB, total_bytes=1000 * GIB)
    )
    findings = doctor.check(facts)
    bad = [f for f in findings if f.severity in ("warning", "critical")]
    assert bad == []
    assert doctor.exit_code(findings) == 0


def _fstrim(root: Path, state: str) -> None:
    """Unit files as systemctl enable/mask and the role's drop-in leave them."""
    vendor = root / "usr/lib/systemd/system/fstrim.timer"
    vendor.parent.mkdir(parents=True, exist_ok=True)
    vendor.write_text("[Timer]\nOnCalendar=weekly\n")
    etc = root / "etc/systemd/system"
    (etc / "timers.target.wants").mkdir(parents=True, exist_ok=True)
    if state == "masked":
        (etc / "fstrim.timer").symlink_to("/dev/null")
        return
    if state in ("enabled", "offpeak"):
        (etc / "timers.target.wants/fstrim.timer").symlink_to(
            "/usr/lib/systemd/system/fstrim.timer"
        )
    if state == "offpeak":
        (etc / "fstrim.timer.d").mkdir()
        (etc / "fstrim.timer.d/10-kvtier-offpeak.conf").write_text(
            f"[Timer]\nOnCalendar=\nOnCalendar={tuning.FSTRIM_ONCALENDAR}\n"
        )


@pytest.mark.parametrize(
    ("state", "severity", "observed"),
    [
        ("masked", "warning", "masked"),
        ("disabled", "warning", "disabled"),
        ("enabled", "info", "enabled"),
        ("offpeak", "ok", f"offpeak ({tuning.FSTRIM_ONCALENDAR})"),
    ],
)
def test_fstrim(host: Path, state: str, severity: str, observed: str) -> None:
    _fstrim(host, state)
    f = _by_id(_facts(host))["fstrim"]
    assert (f.severity, f.observed) == (severity, observed)
    assert f.fix == "kvtier_host_fstrim: offpeak"


@pytest.mark.parametrize(
    ("mode", "severity"),
    [
        ("always [madvise] never", "ok"),
        ("[always] madvise never", "warning"),
        ("always madvise [never]", "info"),
    ],
)
def test_thp(host: Path, mode: str, severity: str) -> None:
    (host / "sys/kernel/mm/transparent_hugepage/enabled").write_text(mode + "\n")
    assert _by_id(_facts(host))["thp"].severity == severity


def test_vfs_cache_pressure_zero_is_critical(host: Path) -> None:
    (host / "proc/sys/vm/vfs_cache_pressure").write_text("0\n")
    findings = doctor.check(_facts(host))
    assert {f.id: f.severity for f in findings}["sysctl.vfs_cache_pressure"] == "critical"
    assert doctor.exit_code(findings) == 2


def test_dirty_bytes_replaces_the_ratio(host: Path) -> None:
    (host / "proc/sys/vm/dirty_bytes").write_text("268435456\n")
    (host / "proc/sys/vm/dirty_ratio").write_text("0\n")
    f = _by_id(_facts(host))["sysctl.dirty_ratio"]
    assert f.severity == "warning" and f.observed == "vm.dirty_bytes = 268435456 (ratio unused)"


@pytest.mark.parametrize(
    ("memlock", "severity"),
    [(-1, "ok"), (3 * GIB, "ok"), (2 * GIB + 1, "warning"), (8 * 1024 * 1024, "critical")],
)
def test_memlock_against_l2(host: Path, memlock: int, severity: str) -> None:
    f = _by_id(_facts(host, memlock=memlock))["memlock"]
    assert f.severity == severity
    assert f.recommended == ">= 3.0 GiB (L2 2.0 GiB + headroom)"
    assert "LimitMEMLOCK=3221225472" in f.fix


def test_without_l2_size_the_l2_checks_say_how(host: Path) -> None:
    found = _by_id(_facts(host, l2=None))
    assert found["memlock"].severity == "info" and "--l2-bytes" in found["memlock"].fix
    assert found["hugepages"].severity == "info"


@pytest.mark.parametrize(
    ("fstype", "severity"), [("tmpfs", "critical"), ("overlay", "warning"), ("xfs", "ok")]
)
def test_l3_filesystem(host: Path, fstype: str, severity: str) -> None:
    info = host / "proc/self/mountinfo"
    info.write_text(info.read_text().replace(" - ext4 /dev/vda ", f" - {fstype} /dev/vda "))
    assert _by_id(_facts(host))["l3.filesystem"].severity == severity


@pytest.mark.parametrize(
    ("mode", "severity"),
    [(0o700, "ok"), (0o750, "warning"), (0o777, "critical"), (0o1777, "critical")],
)
def test_l3_mode(host: Path, mode: int, severity: str) -> None:
    os.chmod(host / "l3", mode)
    f = _by_id(_facts(host))["l3.mode"]
    assert (f.severity, f.observed, f.recommended) == (severity, f"{mode:04o}", "0700")


@pytest.mark.skipif(os.geteuid() != 0, reason="chown to another user needs root")
def test_l3_foreign_owner(host: Path) -> None:
    os.chown(host / "l3", 65534, 65534)
    f = _by_id(_facts(host))["l3.owner"]
    assert f.severity == "warning" and "uid 65534" in f.observed


def test_missing_l3_root_is_measured_at_its_parent(host: Path) -> None:
    found = _by_id(_facts(host, l3_root=host / "l3" / "not" / "yet"))
    assert found["l3.root"].severity == "warning"
    assert found["l3.filesystem"].observed == "ext4 at /"
    assert "l3.o_direct" not in found and "l3.mode" not in found


def test_free_space_thresholds(host: Path) -> None:
    facts = _facts(host)
    assert facts.l3 is not None and facts.l3.total_bytes
    total = 1000 * GIB

    def severity(free: int) -> str:
        l3 = dataclasses.replace(facts.l3, free_bytes=free, total_bytes=total)  # type: ignore[arg-type]
        return _by_id(dataclasses.replace(facts, l3=l3))["l3.free_space"].severity

    assert severity(500 * GIB) == "ok"
    assert severity(100 * GIB) == "warning"
    assert severity(40 * GIB) == "critical"


def test_o_direct_probe_leaves_nothing(tmp_path: Path) -> None:
    assert doctor.probe_o_direct(str(tmp_path)) == "ok"
    assert list(tmp_path.iterdir()) == []
    assert doctor.probe_o_direct(str(tmp_path / "missing")).startswith("probe failed")


def _nvme_tree(root: Path, scheduler: str) -> disk.BlockDevice:
    """vda's captured files moved to an NVMe namespace's place, with a given scheduler."""
    vda = root / "sys/devices/pci0000:00/0000:00:02.0/virtio1/block/vda"
    ns = root / "sys/devices/pci0000:00/0000:00:02.0/nvme/nvme0/nvme0n1"
    ns.parent.mkdir(parents=True)
    shutil.copytree(vda, ns)
    text = (ns / "queue/scheduler").read_text()
    (ns / "queue/scheduler").write_text(
        text.replace("[", "").replace("]", "").replace(scheduler, f"[{scheduler}]")
    )
    (ns / "dev").write_text("259:0\n")
    (root / "sys/dev/block/259:0").symlink_to(
        "../../devices/pci0000:00/0000:00:02.0/nvme/nvme0/nvme0n1"
    )
    device = disk.block_device(259, 0, sys_root=str(root / "sys"))
    assert device is not None
    return device


@pytest.mark.parametrize(
    ("scheduler", "severity"), [("none", "ok"), ("mq-deadline", "warning"), ("bfq", "warning")]
)
def test_nvme_scheduler(host: Path, scheduler: str, severity: str) -> None:
    device = _nvme_tree(host, scheduler)
    f = _by_id(_facts(host, device=device))["l3.scheduler"]
    assert (f.severity, f.observed) == (severity, f"nvme0n1: {scheduler}")
    assert "kvtier_host_nvme_scheduler: none" in f.fix


def test_captured_h200_gpu_and_virtio_drive(host: Path) -> None:
    device = disk.block_device(254, 0, sys_root=str(H200 / "sys"))
    assert device is not None
    found = _by_id(_facts(host, sys_root=H200 / "sys", device=device))
    assert found["pcie.shared"].severity == "ok"
    assert "host_bridge" in found["pcie.shared"].observed
    gpu = found["pcie.link.gpu.0000:00:06.0"]
    assert (gpu.severity, gpu.observed, gpu.recommended) == (
        "ok",
        "32.0 GT/s PCIe x16",
        "32.0 GT/s PCIe x16",
    )


def _switch_tree(
    root: Path, *, gpu_width: str = "16", gpu_speed: str | None = None
) -> disk.BlockDevice:
    """The captured H200 GPU's sysfs files placed behind a PCIe switch next to an NVMe drive."""
    sys_root = root / "sys"
    switch = "devices/pci0000:00/0000:00:01.0/0000:01:00.0"
    gpu, ctrl = f"{switch}/0000:02:00.0/0000:03:00.0", f"{switch}/0000:02:01.0/0000:04:00.0"
    for rel in (gpu, ctrl):
        shutil.copytree(H200 / "sys" / H200_GPU, sys_root / rel, symlinks=True)
        (sys_root / "bus/pci/devices" / rel.rsplit("/", 1)[1]).symlink_to(f"../../../{rel}")
    (sys_root / ctrl / "class").write_text("0x010802\n")
    (sys_root / ctrl / "vendor").write_text("0x144d\n")
    (sys_root / gpu / "current_link_width").write_text(gpu_width + "\n")
    if gpu_speed:
        (sys_root / gpu / "current_link_speed").write_text(gpu_speed + "\n")
    ns = sys_root / ctrl / "nvme/nvme0/nvme0n1"
    shutil.copytree(
        sys_root / "devices/pci0000:00/0000:00:02.0/virtio1/block/vda/queue", ns / "queue"
    )
    (ns / "dev").write_text("259:0\n")
    (sys_root / "dev/block/259:0").symlink_to(f"../../{ctrl}/nvme/nvme0/nvme0n1")
    device = disk.block_device(259, 0, sys_root=str(sys_root))
    assert device is not None
    return device


def test_gpu_and_drive_behind_one_switch(host: Path) -> None:
    found = _by_id(_facts(host, device=_switch_tree(host)))
    f = found["pcie.shared"]
    assert f.severity == "warning"
    assert "0000:03:00.0" in f.observed and "0000:04:00.0" in f.observed and "switch" in f.observed
    assert "kvtier_host_io_write_bandwidth_max" in f.fix
    assert found["pcie.link.drive.0000:04:00.0"].severity == "ok"


@pytest.mark.parametrize(
    ("width", "speed", "severity"),
    [("8", None, "warning"), ("16", "2.5 GT/s PCIe", "info"), ("16", None, "ok")],
)
def test_downgraded_gpu_link(host: Path, width: str, speed: str | None, severity: str) -> None:
    found = _by_id(_facts(host, device=_switch_tree(host, gpu_width=width, gpu_speed=speed)))
    f = found["pcie.link.gpu.0000:03:00.0"]
    assert f.severity == severity
    assert f.recommended == "32.0 GT/s PCIe x16"


def test_command_json_live(tmp_path: Path) -> None:
    """One live run of the console script on this host: the JSON contract and the exit code."""
    l3 = tmp_path / "l3"
    l3.mkdir(mode=0o700)
    env = {**os.environ, "KVTIER_L2_BYTES": "64MiB"}
    proc = subprocess.run(
        [sys.executable, "-m", "ops.cli", "doctor", "--json", "--l3-root", str(l3)],
        capture_output=True, text=True, env=env, timeout=120,
    )  # fmt: skip
    data = json.loads(proc.stdout)
    keys = {"id", "severity", "observed", "recommended", "why", "fix"}
    assert data["findings"] and all(set(f) == keys for f in data["findings"])
    severities = {f["severity"] for f in data["findings"]}
    assert proc.returncode == (
        2 if "critical" in severities else 1 if "warning" in severities else 0
    )
    ids = {f["id"] for f in data["findings"]}
    assert {"memlock", "thp", "l3.o_direct", "l3.filesystem", "l3.free_space", "l3.mode"} <= ids
    by_id = {f["id"]: f for f in data["findings"]}
    assert by_id["l3.o_direct"]["observed"] == "ok" and by_id["l3.mode"]["observed"] == "0700"


def test_command_rejects_a_bad_size(tmp_path: Path) -> None:
    result = CliRunner().invoke(command, ["--l2-size", "lots", "--l3-root", str(tmp_path)])
    assert result.exit_code == 2
    assert "cannot read size 'lots'" in result.output


@pytest.mark.parametrize(("capeff", "severity"), [("0000000000004000", "ok"), ("0", "critical")])
def test_memlock_follows_l2s_rule_on_cap_ipc_lock(host: Path, capeff: str, severity: str) -> None:
    """With CAP_IPC_LOCK, L2 locks past RLIMIT_MEMLOCK, so a low limit is no finding."""
    (host / "proc/self/status").write_text(f"Name:\tkvtier\nCapEff:\t{capeff}\n")
    f = _by_id(_facts(host, memlock=8 * 1024 * 1024))["memlock"]
    assert f.severity == severity
    assert ("CAP_IPC_LOCK" in f.observed) is (severity == "ok")
    assert f.observed.startswith("8.0 MiB")
