"""The kvtier_host role: lint, syntax, a converge into a temporary root, idempotence, check mode,
and the sysctl part applied live (root on a disposable machine only).

ansible-playbook runs take seconds each, so one module-scoped converge serves most assertions.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import stat
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from ops import tuning

REPO = Path(__file__).resolve().parents[2]
ANSIBLE = REPO / "ansible"
BIN = Path(sys.executable).parent
L2 = 3 * tuning.GIB + 1  # not a whole number of huge pages: the count must round up
PLAYBOOK = "---\n- name: Converge\n  hosts: all\n  gather_facts: false\n  roles:\n    - role: kvtier_host\n"

pytestmark = pytest.mark.skipif(
    not (BIN / "ansible-playbook").exists(), reason="ansible is not installed (pip install .[dev])"
)


def _env(home: Path) -> dict[str, str]:
    return {
        **os.environ,
        "PATH": f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}",
        "ANSIBLE_HOME": str(home),
        "ANSIBLE_LOCAL_TEMP": str(home / "tmp"),
        "ANSIBLE_REMOTE_TEMP": str(home / "tmp"),
        "ANSIBLE_ROLES_PATH": str(ANSIBLE / "roles"),
        "ANSIBLE_NOCOLOR": "1",
        "ANSIBLE_RETRY_FILES_ENABLED": "0",
        "ANSIBLE_GALAXY_DISABLE_GPG_VERIFY": "1",
    }


@dataclass
class Run:
    rc: int
    out: str

    @property
    def recap(self) -> dict[str, int]:
        m = re.search(r"localhost\s+:\s+(.*)", self.out)
        assert m, self.out[-3000:]
        return {k: int(v) for k, v in re.findall(r"(\w+)=(\d+)", m.group(1))}


def _play(home: Path, extra: dict[str, object], *args: str) -> Run:
    playbook = home / "converge.yml"
    playbook.write_text(PLAYBOOK)
    extra = {"ansible_python_interpreter": sys.executable, **extra}
    proc = subprocess.run(
        [str(BIN / "ansible-playbook"), "-i", "localhost,", "-c", "local", str(playbook),
         "-e", json.dumps(extra), *args],
        capture_output=True, text=True, env=_env(home), cwd=home, timeout=300,
    )  # fmt: skip
    return Run(proc.returncode, proc.stdout + proc.stderr)


def _vars(root: Path, **more: object) -> dict[str, object]:
    return {
        "kvtier_host_root": str(root),
        "kvtier_host_live": False,
        "kvtier_host_l2_bytes": L2,
        "kvtier_host_user": "root",
        "kvtier_host_group": "root",
        "kvtier_host_l3_device": "/dev/nvme0n1",
        "kvtier_host_io_write_bandwidth_max": "1500M",
        **more,
    }


@dataclass
class Converged:
    home: Path
    root: Path
    first: Run
    second: Run
    check: Run


@pytest.fixture(scope="module")
def converged(tmp_path_factory: pytest.TempPathFactory) -> Converged:
    home = tmp_path_factory.mktemp("ansible")
    root = home / "root"
    root.mkdir()
    first = _play(home, _vars(root))
    assert first.rc == 0, first.out[-4000:]
    second = _play(home, _vars(root))
    check = _play(home, _vars(root), "--check", "--diff")
    return Converged(home, root, first, second, check)


HUGE_UNIT = "var-lib-kvtier-hugepages.mount"
MANAGED = "# Ansible managed (role kvtier_host)\n"


def _expected() -> dict[str, tuple[int, str]]:
    """Every file the converge must leave: relative path -> (mode, exact content)."""
    values = tuning.sysctl_values(L2)
    sysctl = (
        "# Ansible managed (role kvtier_host; values and reasons: ops/tuning.py, docs/host-tuning.md)\n"
        "# vm.vfs_cache_pressure governs the dentry and inode caches (L3 keeps one file per chunk), not\n"
        "# the page cache.\n"
        f"vm.vfs_cache_pressure = {values['vm.vfs_cache_pressure']}\n"
        "# Cap dirty page cache so a flush never stalls writers for long; background writeback starts early.\n"
        f"vm.dirty_ratio = {values['vm.dirty_ratio']}\n"
        f"vm.dirty_background_ratio = {values['vm.dirty_background_ratio']}\n"
        "# ceil(L2 bytes / 2048 KiB): huge pages for the pinned L2 arena.\n"
        f"vm.nr_hugepages = {values['vm.nr_hugepages']}\n"
    )
    mount = MANAGED + (
        "[Unit]\nDescription=hugetlbfs for the kvtier L2 arena\nDefaultDependencies=no\n"
        "ConditionPathExists=/sys/kernel/mm/hugepages\nBefore=local-fs.target umount.target\n"
        "Conflicts=umount.target\n\n[Mount]\nWhat=hugetlbfs\nWhere=/var/lib/kvtier/hugepages\n"
        "Type=hugetlbfs\nOptions=pagesize=2048K,mode=1770\n\n[Install]\nWantedBy=local-fs.target\n"
    )
    slice_ = MANAGED + (
        "# IO limits live here, on the serving unit's slice: systemd re-applies them at every boot, which\n"
        "# writing io.max into cgroupfs by hand does not.\n"
        "[Unit]\nDescription=kvtier KV-cache serving\nBefore=slices.target\n\n"
        "[Slice]\nIOAccounting=yes\nMemoryAccounting=yes\nIOWriteBandwidthMax=/dev/nvme0n1 1500M\n"
    )
    dropin = MANAGED + (
        "[Unit]\nRequiresMountsFor=/var/lib/kvtier/l3 /var/lib/kvtier/hugepages\n\n"
        "[Service]\nSlice=kvtier.slice\n# The pinned L2 arena plus headroom (ops.tuning.memlock_bytes).\n"
        f"LimitMEMLOCK={tuning.memlock_bytes(L2)}\n"
    )
    udev = MANAGED + (
        "# NVMe namespaces: no software I/O scheduler (deep hardware queues; O_DIRECT chunk reads).\n"
        'ACTION=="add|change", KERNEL=="nvme[0-9]*n[0-9]*", ENV{DEVTYPE}=="disk", '
        'ATTR{queue/scheduler}="none"\n'
    )
    fstrim = MANAGED + (
        "# Keep trimming (an SSD that is never trimmed slowly loses write speed), off-peak only.\n"
        f"[Timer]\nOnCalendar=\nOnCalendar={tuning.FSTRIM_ONCALENDAR}\nRandomizedDelaySec=30min\n"
        "# Not Persistent: a missed window must not trim at boot, in the middle of the day.\n"
        "Persistent=false\n"
    )
    unit_dir = "etc/systemd/system"
    return {
        "etc/sysctl.d/90-kvtier.conf": (0o644, sysctl),
        f"{unit_dir}/{HUGE_UNIT}": (0o644, mount),
        f"{unit_dir}/kvtier.slice": (0o644, slice_),
        f"{unit_dir}/kvtier.service.d/10-kvtier-host.conf": (0o644, dropin),
        "etc/udev/rules.d/60-kvtier-nvme-scheduler.rules": (0o644, udev),
        f"{unit_dir}/fstrim.timer.d/10-kvtier-offpeak.conf": (0o644, fstrim),
    }


def _tree(root: Path) -> dict[str, os.stat_result]:
    return {str(p.relative_to(root)): p.lstat() for p in root.rglob("*")}


def test_ansible_lint_production_offline(tmp_path: Path) -> None:
    proc = subprocess.run(
        [str(BIN / "ansible-lint"), "--offline", "--profile", "production", "--nocolor", "ansible/"],
        capture_output=True, text=True, cwd=REPO, env=_env(tmp_path), timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "Profile 'production' was required, and it passed" in proc.stdout + proc.stderr


def test_syntax_check(tmp_path: Path) -> None:
    proc = subprocess.run(
        [str(BIN / "ansible-playbook"), "--syntax-check",
         "-i", str(ANSIBLE / "inventory.example.ini"), str(ANSIBLE / "site.yml")],
        capture_output=True, text=True, env=_env(tmp_path), cwd=tmp_path, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_converge_writes_every_file_with_content_and_mode(converged: Converged) -> None:
    assert converged.first.recap["failed"] == 0 and converged.first.recap["changed"] > 0
    tree = _tree(converged.root)
    files = {rel: st for rel, st in tree.items() if stat.S_ISREG(st.st_mode)}
    expected = _expected()
    assert set(files) == set(expected)
    for rel, (mode, content) in expected.items():
        assert stat.S_IMODE(files[rel].st_mode) == mode, rel
        assert files[rel].st_uid == 0 or os.geteuid() != 0, rel
        assert (converged.root / rel).read_text() == content, rel
    # The boot-time enablement of the mount is the link systemctl enable would make.
    wants = converged.root / "etc/systemd/system/local-fs.target.wants" / HUGE_UNIT
    assert os.readlink(wants) == f"/etc/systemd/system/{HUGE_UNIT}"
    l3 = tree["var/lib/kvtier/l3"]
    assert stat.S_ISDIR(l3.st_mode) and stat.S_IMODE(l3.st_mode) == 0o700
    assert stat.S_IMODE(tree["var/lib/kvtier"].st_mode) == 0o755  # the service user can traverse
    dirs = {rel for rel, st in tree.items() if stat.S_ISDIR(st.st_mode)}
    for rel in dirs - {"var/lib/kvtier/l3", "var", "var/lib"}:
        assert stat.S_IMODE(tree[rel].st_mode) == 0o755, rel


def test_second_run_changes_nothing(converged: Converged) -> None:
    recap = converged.second.recap
    assert converged.second.rc == 0 and recap["changed"] == 0 and recap["failed"] == 0


def test_check_diff_reports_no_changes(converged: Converged) -> None:
    recap = converged.check.recap
    assert converged.check.rc == 0 and recap["changed"] == 0
    assert "--- before" not in converged.check.out


def test_fstrim_disabled_and_hugepages_off(converged: Converged, tmp_path: Path) -> None:
    root = tmp_path / "root"
    shutil.copytree(converged.root, root, symlinks=True)
    run = _play(tmp_path, _vars(root, kvtier_host_fstrim="disabled", kvtier_host_hugepages=False))
    assert run.rc == 0, run.out[-4000:]
    units = root / "etc/systemd/system"
    assert os.readlink(units / "fstrim.timer") == "/dev/null"  # masked, as systemctl mask does
    assert not (units / "fstrim.timer.d/10-kvtier-offpeak.conf").exists()
    assert not (units / HUGE_UNIT).exists()
    assert not os.path.lexists(units / "local-fs.target.wants" / HUGE_UNIT)
    assert "vm.nr_hugepages = 0\n" in (root / "etc/sysctl.d/90-kvtier.conf").read_text()
    assert (
        "RequiresMountsFor=/var/lib/kvtier/l3\n"
        in (units / "kvtier.service.d/10-kvtier-host.conf").read_text()
    )


@pytest.mark.parametrize(
    ("more", "message"),
    [
        ({"kvtier_host_fstrim": "never"}, "kvtier_host_fstrim"),
        ({"kvtier_host_l2_bytes": None}, "kvtier_host_l2_bytes"),
        ({"kvtier_host_dirty_background_ratio": 30}, "below kvtier_host_dirty_ratio"),
    ],
)
def test_bad_variables_fail_before_any_change(tmp_path: Path, more: dict, message: str) -> None:
    root = tmp_path / "root"
    root.mkdir()
    extra = _vars(root, **more)
    extra = {k: v for k, v in extra.items() if v is not None}
    run = _play(tmp_path, extra)
    assert run.rc != 0 and message in run.out
    assert list(root.iterdir()) == []


FLEET_HOSTS = ["127.0.0.1:8001", "127.0.0.1:8002", "[::1]:8003"]


def test_fleet_part_writes_the_cli_configuration(converged: Converged, tmp_path: Path) -> None:
    """kvtier_host_fleet on: HAProxy's configuration is the very text `kvtier fleet
    haproxy-config` writes for the same hosts and options, and HAProxy accepts it. Off (the
    converge above), the role writes no HAProxy file at all."""
    assert not (converged.root / "etc/haproxy").exists()
    root = tmp_path / "root"
    shutil.copytree(converged.root, root, symlinks=True)
    fleet = {
        "kvtier_host_fleet": True,
        "kvtier_host_fleet_hosts": FLEET_HOSTS,
        "kvtier_host_fleet_check_ms": 300,
        "kvtier_host_fleet_stats_bind": "127.0.0.1:8404",
    }
    run = _play(tmp_path, _vars(root, **fleet))
    assert run.rc == 0 and run.recap["changed"] > 0, run.out[-4000:]
    cfg = root / "etc/haproxy/haproxy.cfg"
    assert stat.S_IMODE(cfg.stat().st_mode) == 0o644
    cli = subprocess.run(
        [sys.executable, "-m", "ops.cli", "fleet", "haproxy-config", "--hosts",
         ",".join(FLEET_HOSTS), "--check-ms", "300", "--stats-bind", "127.0.0.1:8404"],
        capture_output=True, text=True, cwd=REPO, timeout=60, check=True,
    )  # fmt: skip
    assert cfg.read_text() == cli.stdout
    assert "    server kvtier3 [::1]:8003 check\n" in cli.stdout
    again = _play(tmp_path, _vars(root, **fleet))
    assert again.rc == 0 and again.recap["changed"] == 0, again.out[-4000:]
    if shutil.which("haproxy") is None:
        pytest.skip("haproxy is not installed (bootstrap installs it): `haproxy -c` not run")
    check = subprocess.run(["haproxy", "-c", "-f", str(cfg)], capture_output=True, text=True)
    assert check.returncode == 0, check.stdout + check.stderr


@pytest.mark.parametrize(
    "hosts", [[], ["10.0.0.1"], ["10.0.0.1:8000", "10.0.0.1:8000"], ["10.0.0.1:8000 check"]]
)
def test_fleet_part_refuses_bad_hosts(tmp_path: Path, hosts: list[str]) -> None:
    root = tmp_path / "root"
    root.mkdir()
    run = _play(tmp_path, _vars(root, kvtier_host_fleet=True, kvtier_host_fleet_hosts=hosts))
    assert run.rc != 0 and "kvtier_host_fleet_hosts must name each" in run.out, run.out[-3000:]
    assert list(root.iterdir()) == []  # refused before any change


SYSCTL_FILE = Path("/etc/sysctl.d/90-kvtier.conf")


@pytest.mark.root
def test_sysctl_applied_live(tmp_path: Path) -> None:
    """Apply the sysctl part on this (disposable, root) machine and read it back with sysctl -n."""
    if os.geteuid() != 0:
        pytest.skip("needs root: writes /etc/sysctl.d and runs sysctl --system")
    if not os.access("/proc/sys/vm/dirty_ratio", os.W_OK) or shutil.which("sysctl") is None:
        pytest.skip("/proc/sys is read-only here (or sysctl is missing)")
    l2 = 64 * tuning.MIB + 1  # 33 huge pages: small enough to reserve anywhere
    want = tuning.sysctl_values(l2)
    keys = list(want)
    before = {
        k: subprocess.run(["sysctl", "-n", k], capture_output=True, text=True).stdout.strip()
        for k in keys
    }
    old_file = SYSCTL_FILE.read_bytes() if SYSCTL_FILE.exists() else None
    try:
        run = _play(
            tmp_path,
            {"kvtier_host_l2_bytes": l2, "kvtier_host_live": True},
            "--tags", "sysctl",
        )  # fmt: skip
        assert run.rc == 0, run.out[-4000:]
        assert "RUNNING HANDLER [kvtier_host : Apply sysctl settings]" in run.out
        for key, value in want.items():
            got = subprocess.run(["sysctl", "-n", key], capture_output=True, text=True, check=True)
            assert got.stdout.strip() == str(value), key
    finally:
        if old_file is None:
            SYSCTL_FILE.unlink(missing_ok=True)
        else:
            SYSCTL_FILE.write_bytes(old_file)
        for key, value in before.items():
            subprocess.run(["sysctl", "-q", "-w", f"{key}={value}"], check=False)
