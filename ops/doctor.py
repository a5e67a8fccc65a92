"""`kvtier doctor`: check a host against the recommended tuning of ops.tuning, and more.

Two halves, so that every check is testable from captured /proc and /sys trees:
`collect(...)` reads the host (all paths under `proc_root`, `sys_root` and `fs_root`) into a
frozen `Facts`; `check(facts)` is a pure function of those facts that returns one `Finding` per
check. A finding says what was observed, what is recommended, why, and the fix (the role
variable of ansible/roles/kvtier_host or a command).
"""

from __future__ import annotations

import contextlib
import errno
import functools
import glob
import mmap
import os
import pwd
import stat
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field

from kvtier.tiers import memlock as memlock_rule
from ops import tuning
from ops.collectors import disk, pcie
from ops.collectors._files import read_attr, read_text
from ops.parsers import meminfo, mountinfo

SEVERITIES = ("ok", "info", "warning", "critical")
SYSCTLS = (
    "vfs_cache_pressure",
    "dirty_ratio",
    "dirty_background_ratio",
    "dirty_bytes",
    "dirty_background_bytes",
    "nr_hugepages",
)
ROLE = "ansible/roles/kvtier_host"


@dataclass(frozen=True)
class Finding:
    """One check's result; `severity` is one of SEVERITIES."""

    id: str
    severity: str
    observed: str
    recommended: str
    why: str
    fix: str

    def as_dict(self) -> dict[str, str]:
        return asdict(self)


@dataclass(frozen=True)
class L3Facts:
    """The L3 root and the filesystem and block device under it."""

    path: str
    exists: bool
    probed: str  # the path measured: the root, or its nearest existing ancestor
    fstype: str | None = None
    mount_point: str | None = None
    free_bytes: int | None = None
    total_bytes: int | None = None
    uid: int | None = None
    owner: str | None = None
    mode: int | None = None
    expected_uid: int | None = None
    expected_owner: str | None = None
    o_direct: str | None = None  # "ok", or why the probe failed
    device: str | None = None  # whole-disk name (nvme0n1, vda, dm-0)
    schedulers: tuple[tuple[str, str], ...] = ()  # (disk, active scheduler) of NVMe members


@dataclass(frozen=True)
class LinkFacts:
    """A PCIe function's link as sysfs reports it."""

    role: str  # "gpu" or "drive"
    bus_id: str
    link: pcie.Link


@dataclass(frozen=True)
class Facts:
    """Everything doctor looked at; None means the host did not say."""

    sysctl: dict[str, int | None]
    hugepages_total: int | None
    hugepage_kb: int | None
    hugetlbfs_mounts: tuple[str, ...]
    thp: str | None  # the bracketed mode of transparent_hugepage/enabled
    memlock: int | None  # soft RLIMIT_MEMLOCK in bytes; -1 is unlimited
    l2_bytes: int | None
    fstrim: str  # "offpeak", "enabled", "disabled", "masked", "absent"
    fstrim_calendar: str | None
    l3: L3Facts | None
    topology: tuple[pcie.TopologyFinding, ...] = ()
    links: tuple[LinkFacts, ...] = field(default_factory=tuple)
    gpus: int = 0
    cap_ipc_lock: bool = False  # the process may lock beyond RLIMIT_MEMLOCK (L2 then ignores it)
    swaps: tuple[tuple[str, str], ...] | None = (
        None  # active swap areas (name, type); None: unknown
    )
    mem_total: int | None = None  # /proc/meminfo MemTotal, bytes
    mem_available: int | None = None  # MemAvailable: what L2 may take now, bytes


# ---- collection (I/O) ---------------------------------------------------------------------------


def _int(text: str | None) -> int | None:
    try:
        return int(text.split()[0]) if text else None
    except ValueError:
        return None


def _bracketed(text: str | None) -> str | None:
    """The active choice of a sysfs list such as `always [madvise] never`."""
    if not text:
        return None
    for word in text.split():
        if word.startswith("[") and word.endswith("]"):
            return word[1:-1]
    return None


def _existing(path: str) -> str:
    path = os.path.abspath(path)
    while not os.path.exists(path) and path != os.path.dirname(path):
        path = os.path.dirname(path)
    return path


def probe_o_direct(directory: str) -> str:
    """Write and read back one 4 KiB block with O_DIRECT in `directory`: "ok" or the reason."""
    flag = getattr(os, "O_DIRECT", 0)
    if not flag:
        return "this platform has no O_DIRECT"
    name = os.path.join(directory, f".kvtier-doctor-{os.getpid()}.probe")
    buf = mmap.mmap(-1, 4096)  # page-aligned, as O_DIRECT requires
    buf.write(b"kvtier" * 682 + b"\0" * 4)
    try:
        fd = os.open(name, os.O_RDWR | os.O_CREAT | os.O_EXCL | flag, 0o600)
    except OSError as exc:
        return _o_direct_error(exc)
    try:
        os.write(fd, buf)
        os.fsync(fd)
        back = mmap.mmap(-1, 4096)
        os.preadv(fd, [back], 0)
        return "ok" if back[:] == buf[:] else "data read back with O_DIRECT differs"
    except OSError as exc:
        return _o_direct_error(exc)
    finally:
        os.close(fd)
        with contextlib.suppress(OSError):
            os.unlink(name)


def _o_direct_error(exc: OSError) -> str:
    if exc.errno == errno.EINVAL:
        return "the filesystem refuses O_DIRECT (EINVAL)"
    return f"probe failed: {os.strerror(exc.errno or 0)}"


def _nvme_schedulers(device: disk.BlockDevice) -> tuple[tuple[str, str], ...]:
    """(disk, active scheduler) of every NVMe namespace under the device (dm/md: its members)."""
    found: list[tuple[str, str]] = []

    def walk(path: str, depth: int) -> None:
        slaves = sorted(glob.glob(os.path.join(path, "slaves", "*")))
        if slaves and depth < 8:
            for slave in slaves:
                walk(os.path.realpath(slave), depth + 1)
            return
        if read_attr(path, "partition") is not None:
            path = os.path.dirname(path)
        name = os.path.basename(path)
        if name.startswith("nvme"):
            found.append((name, _bracketed(read_attr(path, "queue/scheduler")) or "?"))

    walk(device.sys_path, 0)
    return tuple(found)


def _owner(uid: int) -> str:
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return str(uid)


def expected_owner(name: str | None) -> tuple[int, str]:
    """The uid the L3 root should belong to: `name`, else the service user, else this user."""
    for candidate in (name,) if name else (tuning.SERVICE,):
        try:
            entry = pwd.getpwnam(candidate)
            return entry.pw_uid, entry.pw_name
        except KeyError:
            if name:
                return -1, f"{name} (no such user)"
    return os.geteuid(), _owner(os.geteuid())


def collect_l3(
    l3_root: str,
    *,
    proc_root: str = "/proc",
    sys_root: str = "/sys",
    owner: str | None = None,
    device: disk.BlockDevice | None = None,
) -> L3Facts:
    """Facts about the L3 root; a missing root is measured at its nearest existing ancestor."""
    path = os.path.abspath(l3_root)
    probed = _existing(path)
    exists = probed == path and os.path.isdir(path)
    mounts = mountinfo.parse(read_text(os.path.join(proc_root, "self", "mountinfo")) or "")
    mount = mountinfo.mount_of(mounts, os.path.realpath(probed))
    vfs = os.statvfs(probed)
    st = os.stat(probed)
    uid, expected = expected_owner(owner)
    device = device or disk.device_of(probed, sys_root=sys_root, proc_root=proc_root)
    return L3Facts(
        path=path,
        exists=exists,
        probed=probed,
        fstype=mount.fstype if mount else None,
        mount_point=mount.mount_point if mount else None,
        free_bytes=vfs.f_bavail * vfs.f_frsize,
        total_bytes=vfs.f_blocks * vfs.f_frsize,
        uid=st.st_uid if exists else None,
        owner=_owner(st.st_uid) if exists else None,
        mode=stat.S_IMODE(st.st_mode) if exists else None,
        expected_uid=uid,
        expected_owner=expected,
        o_direct=probe_o_direct(path) if exists else None,
        device=device.name if device else None,
        schedulers=_nvme_schedulers(device) if device else (),
    )


def collect_fstrim(fs_root: str = "/") -> tuple[str, str | None]:
    """fstrim.timer's state from the unit files systemd reads (no running systemd needed)."""
    etc = os.path.join(fs_root, "etc", "systemd", "system")
    unit = os.path.join(etc, "fstrim.timer")
    if os.path.islink(unit) and os.readlink(unit) == "/dev/null":
        return "masked", None
    vendor = [
        os.path.join(fs_root, d, "systemd", "system", "fstrim.timer") for d in ("usr/lib", "lib")
    ]
    if not any(os.path.exists(p) for p in [unit, *vendor]):
        return "absent", None
    calendar = None
    for conf in sorted(glob.glob(os.path.join(etc, "fstrim.timer.d", "*.conf"))):
        for line in (read_text(conf) or "").splitlines():
            key, _, value = line.partition("=")
            if key.strip() == "OnCalendar":
                calendar = value.strip() or None  # an empty assignment resets the list
    if not os.path.lexists(os.path.join(etc, "timers.target.wants", "fstrim.timer")):
        return "disabled", calendar
    return ("offpeak" if calendar else "enabled"), calendar


def collect_links(sys_root: str, topology: list[pcie.TopologyFinding]) -> tuple[LinkFacts, ...]:
    """Links of every GPU and of the L3 drive's PCI functions."""
    links = [
        LinkFacts("gpu", os.path.basename(path), pcie.link(path)) for path in pcie.gpus(sys_root)
    ]
    drives = {t.drive: t.drive_link for t in topology}
    links += [LinkFacts("drive", bus_id, link) for bus_id, link in sorted(drives.items())]
    return tuple(links)


def collect(
    *,
    l3_root: str | None,
    l2_bytes: int | None,
    proc_root: str = "/proc",
    sys_root: str = "/sys",
    fs_root: str = "/",
    owner: str | None = None,
    memlock: int | None = None,
    cap_ipc_lock: bool | None = None,
    device: disk.BlockDevice | None = None,
) -> Facts:
    """Read the host. `memlock`, `cap_ipc_lock` and `device` override what this process sees
    (tests)."""
    vm = os.path.join(proc_root, "sys", "vm")
    sysctl = {name: _int(read_text(os.path.join(vm, name))) for name in SYSCTLS}
    info = meminfo.parse(read_text(os.path.join(proc_root, "meminfo")) or "")
    mounts = mountinfo.parse(read_text(os.path.join(proc_root, "self", "mountinfo")) or "")
    if memlock is None:
        memlock = memlock_rule.soft_memlock()
    if cap_ipc_lock is None:
        cap_ipc_lock = memlock_rule.has_cap_ipc_lock(os.path.join(proc_root, "self", "status"))
    fstrim, calendar = collect_fstrim(fs_root)
    l3 = None
    topology: list[pcie.TopologyFinding] = []
    if l3_root:
        l3 = collect_l3(l3_root, proc_root=proc_root, sys_root=sys_root, owner=owner, device=device)
        topology = pcie.read_topology(l3.probed, sys_root=sys_root, device=device)
    thp = read_text(os.path.join(sys_root, "kernel", "mm", "transparent_hugepage", "enabled"))
    swaps_text = read_text(os.path.join(proc_root, "swaps"))
    return Facts(
        sysctl=sysctl,
        hugepages_total=info.hugepages_total,
        hugepage_kb=info.hugepage_size // 1024 if info.hugepage_size else None,
        hugetlbfs_mounts=tuple(m.mount_point for m in mounts if m.fstype == "hugetlbfs"),
        thp=_bracketed(thp),
        memlock=memlock,
        l2_bytes=l2_bytes,
        fstrim=fstrim,
        fstrim_calendar=calendar,
        l3=l3,
        topology=tuple(topology),
        links=collect_links(sys_root, topology),
        gpus=len(pcie.gpus(sys_root)),
        cap_ipc_lock=cap_ipc_lock,
        swaps=None if swaps_text is None else parse_swaps(swaps_text),
        mem_total=info.mem_total,
        mem_available=info.mem_available,
    )


def parse_swaps(text: str) -> tuple[tuple[str, str], ...]:
    """(name, type) of each active swap area in /proc/swaps (its first line is a header)."""
    rows = [line.split() for line in text.splitlines()[1:]]
    return tuple((r[0], r[1]) for r in rows if len(r) >= 2)


# ---- checks (pure) ------------------------------------------------------------------------------


def _size(n: int | None) -> str:
    if n is None:
        return "unknown"
    if n < 0:
        return "unlimited"
    for unit, scale in (("GiB", tuning.GIB), ("MiB", tuning.MIB), ("KiB", tuning.KIB)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} B"


def _var(name: str, value: object) -> str:
    return f"set {tuning.ROLE}_{name}: {value} ({ROLE}) or run the role"


def check_sysctl(facts: Facts) -> Iterator[Finding]:
    """vm.vfs_cache_pressure and the dirty ratios against the role's values."""
    s = facts.sysctl
    pressure = s.get("vfs_cache_pressure")
    want = tuning.VFS_CACHE_PRESSURE
    sev = "ok" if pressure == want else ("critical" if pressure == 0 else "warning")
    if pressure is None:
        sev = "info"
    yield Finding(
        "sysctl.vfs_cache_pressure", sev, str(pressure), str(want),
        tuning.VFS_CACHE_PRESSURE_WHY, _var("vfs_cache_pressure", want),
    )  # fmt: skip
    for name, want, why, bytes_name in (
        ("dirty_ratio", tuning.DIRTY_RATIO, tuning.DIRTY_RATIO_WHY, "dirty_bytes"),
        (
            "dirty_background_ratio",
            tuning.DIRTY_BACKGROUND_RATIO,
            tuning.DIRTY_BACKGROUND_RATIO_WHY,
            "dirty_background_bytes",
        ),
    ):
        value, by_bytes = s.get(name), s.get(bytes_name)
        observed = str(value)
        if by_bytes:  # the kernel zeroes the ratio when the _bytes form is set
            observed = f"vm.{bytes_name} = {by_bytes} (ratio unused)"
        sev = "ok" if value == want and not by_bytes else "warning"
        if value is None and by_bytes is None:
            sev = "info"
        yield Finding(f"sysctl.{name}", sev, observed, str(want), why, _var(name, want))
    ratio, background = s.get("dirty_ratio"), s.get("dirty_background_ratio")
    if ratio and background is not None and background >= ratio:
        yield Finding(
            "sysctl.dirty_order", "warning",
            f"dirty_background_ratio {background} >= dirty_ratio {ratio}",
            "dirty_background_ratio < dirty_ratio", tuning.DIRTY_BACKGROUND_RATIO_WHY,
            _var("dirty_background_ratio", tuning.DIRTY_BACKGROUND_RATIO),
        )  # fmt: skip


def _l2_unknown(check_id: str, why: str) -> Finding:
    return Finding(
        check_id, "info", "L2 size not given", "pass the L2 size", why,
        "kvtier doctor --l2-bytes SIZE (or KVTIER_L2_BYTES), as the server's --l2-bytes",
    )  # fmt: skip


def check_memory(facts: Facts) -> Iterator[Finding]:
    """RLIMIT_MEMLOCK and huge pages against the configured L2, and the THP mode."""
    l2 = facts.l2_bytes
    if l2 is None:
        yield _l2_unknown("memlock", tuning.MEMLOCK_WHY)
        yield _l2_unknown("hugepages", tuning.HUGEPAGES_WHY)
    else:
        # L2's own rule (kvtier.tiers.memlock): CAP_IPC_LOCK lifts the limit.
        want = tuning.memlock_bytes(l2)
        have = facts.memlock
        observed = _size(have)
        if facts.cap_ipc_lock:
            sev, observed = "ok", f"{observed} (not applied: the process has CAP_IPC_LOCK)"
        elif have is None:
            sev = "info"
        else:
            rule = functools.partial(
                memlock_rule.memlock_allows, soft_limit=have, cap_ipc_lock=False
            )
            sev = "ok" if rule(want)[0] else "warning" if rule(l2)[0] else "critical"
        yield Finding(
            "memlock", sev, observed, f">= {_size(want)} (L2 {_size(l2)} + headroom)",
            tuning.MEMLOCK_WHY,
            f"LimitMEMLOCK={want} in the service drop-in ({tuning.ROLE}_l2_bytes: {l2}), "
            "or `ulimit -l` / limits.conf memlock for a shell",
        )  # fmt: skip
        page_kb = facts.hugepage_kb or tuning.HUGEPAGE_KB
        pages = tuning.nr_hugepages(l2, page_kb)
        total = facts.hugepages_total
        sev = "info" if total is None else ("ok" if total >= pages else "warning")
        yield Finding(
            "hugepages", sev, f"{total} x {page_kb} KiB", f">= {pages} x {page_kb} KiB",
            tuning.HUGEPAGES_WHY,
            f"{tuning.ROLE}_l2_bytes: {l2} (vm.nr_hugepages = {pages}); "
            f"now: sysctl -w vm.nr_hugepages={pages}",
        )  # fmt: skip
        if pages:
            mounted = ", ".join(facts.hugetlbfs_mounts) or "none"
            yield Finding(
                "hugetlbfs", "ok" if facts.hugetlbfs_mounts else "info", mounted,
                f"hugetlbfs at {tuning.HUGETLBFS_MOUNT}", tuning.HUGETLBFS_WHY,
                f"{tuning.ROLE}_hugepages: true (a systemd .mount unit)",
            )  # fmt: skip
    thp = facts.thp
    sev = {None: "info", tuning.THP_MODE: "ok", "never": "info"}.get(thp, "warning")
    yield Finding(
        "thp", sev, str(thp), tuning.THP_MODE, tuning.THP_WHY,
        "echo madvise > /sys/kernel/mm/transparent_hugepage/enabled; "
        "kernel command line transparent_hugepage=madvise to keep it",
    )  # fmt: skip


def check_l2_ram(facts: Facts) -> Iterator[Finding]:
    """The L2 size against the host's memory, by L2's own rule (kvtier.tiers.l2): L2 plus
    headroom within MemAvailable, or the server refuses to start; past MemTotal it never can."""
    l2 = facts.l2_bytes
    if l2 is None:
        yield _l2_unknown("l2.ram", tuning.L2_RAM_WHY)
        return
    need = l2 + tuning.L2_RAM_HEADROOM_BYTES
    total, available = facts.mem_total, facts.mem_available
    observed = f"MemTotal {_size(total)}, MemAvailable {_size(available)}"
    recommended = f"MemAvailable >= {_size(need)} (L2 {_size(l2)} + headroom)"
    where = f"the server's --l2-bytes ({tuning.ROLE}_l2_bytes)"
    if total is not None and need > total:
        sev = "critical"
        fix = (
            f"lower {where} well below this host's {_size(total)} of memory, leaving room for "
            "the model's weights and the rest of the host, or serve on a host with more memory"
        )
    elif available is not None and need > available:
        sev = "warning"
        fix = (
            f"lower {where} to at most {_size(max(0, available - tuning.L2_RAM_HEADROOM_BYTES))}"
            ", or free host memory first (a kvtier serve running now holds its own L2: check "
            "before it starts)"
        )
    else:
        sev = "ok" if total is not None or available is not None else "info"
        fix = "none needed" if sev == "ok" else "check /proc/meminfo on the host"
    yield Finding("l2.ram", sev, observed, recommended, tuning.L2_RAM_WHY, fix)


SWAP_WHY = (
    "swapped-out pages of the server (request text, token ids, KV being staged, unwrapped data "
    "keys) would sit on a disk in plaintext, outside the encryption at rest of L3 and beyond "
    "the reach of a crypto-shred (docs/security.md); the locked L2 arena never swaps"
)


def check_swap(facts: Facts) -> Iterator[Finding]:
    """Active swap on a disk: warn (docs/security.md). Swap in compressed RAM (zram) is RAM."""
    if facts.swaps is None:
        yield Finding(
            "swap", "info", "unknown (/proc/swaps unreadable)", "no swap on disk", SWAP_WHY,
            "check with `swapon --show` on the host; turn disk swap off (swapoff -a, /etc/fstab)",
        )  # fmt: skip
        return
    disk_swaps = [name for name, _ in facts.swaps if not os.path.basename(name).startswith("zram")]
    ram = len(facts.swaps) - len(disk_swaps)
    if disk_swaps:
        sev, observed = "warning", "active: " + ", ".join(disk_swaps)
    elif ram:
        sev, observed = "info", f"{ram} zram area(s) only (compressed RAM, not a disk)"
    else:
        sev, observed = "ok", "none"
    yield Finding(
        "swap", sev, observed, "no swap on disk", SWAP_WHY,
        "swapoff -a now; remove the swap lines from /etc/fstab (or `systemctl mask` the "
        "swap units) so it stays off; or encrypt swap with a random key at boot (crypttab)",
    )  # fmt: skip


def check_fstrim(facts: Facts) -> Iterator[Finding]:
    """fstrim.timer: off-peak is recommended; masked or disabled slowly degrades the SSD."""
    sev = {"offpeak": "ok", "enabled": "info", "absent": "info"}.get(facts.fstrim, "warning")
    observed = facts.fstrim + (f" ({facts.fstrim_calendar})" if facts.fstrim_calendar else "")
    yield Finding(
        "fstrim", sev, observed, f"offpeak ({tuning.FSTRIM_ONCALENDAR})", tuning.FSTRIM_WHY,
        f"{tuning.ROLE}_fstrim: offpeak",
    )  # fmt: skip


def check_l3(facts: Facts) -> Iterator[Finding]:
    """The L3 root: filesystem, free space, O_DIRECT, owner and mode, NVMe scheduler."""
    l3 = facts.l3
    if l3 is None:
        yield Finding(
            "l3.root", "info", "no L3 root given", "an L3 root on a local SSD", tuning.L3_ROOT_WHY,
            "kvtier doctor --l3-root DIR (or KVTIER_L3_ROOT)",
        )  # fmt: skip
        return
    fix_root = f"{tuning.ROLE}_l3_root: {l3.path}"
    if not l3.exists:
        yield Finding(
            "l3.root", "warning", f"{l3.path} does not exist (measured {l3.probed})",
            "an existing directory, mode 0700", tuning.L3_ROOT_WHY, fix_root,
        )  # fmt: skip
    fs = l3.fstype or "unknown"
    yield Finding(
        "l3.filesystem", tuning.L3_BAD_FILESYSTEMS.get(fs, "ok"),
        f"{fs} at {l3.mount_point}", "a local SSD filesystem (ext4, xfs)",
        tuning.L3_FILESYSTEM_WHY, f"{fix_root} on a local NVMe filesystem",
    )  # fmt: skip
    if l3.free_bytes is not None and l3.total_bytes:
        ratio = l3.free_bytes / l3.total_bytes
        sev = "ok"
        if ratio < tuning.L3_FREE_WARNING_RATIO:
            sev = "warning"
        if ratio < tuning.L3_FREE_CRITICAL_RATIO or l3.free_bytes < tuning.L3_FREE_CRITICAL_BYTES:
            sev = "critical"
        yield Finding(
            "l3.free_space", sev,
            f"{_size(l3.free_bytes)} free of {_size(l3.total_bytes)} ({ratio:.0%})",
            f">= {tuning.L3_FREE_WARNING_RATIO:.0%} free", tuning.L3_FREE_WHY,
            "lower the L3 capacity cap or run `kvtier l3 gc`; free space on the filesystem",
        )  # fmt: skip
    if l3.o_direct is not None:
        yield Finding(
            "l3.o_direct", "ok" if l3.o_direct == "ok" else "warning", l3.o_direct,
            "O_DIRECT works", tuning.O_DIRECT_WHY, f"{fix_root} on ext4 or xfs",
        )  # fmt: skip
    yield from _check_owner(l3, fix_root)
    if l3.schedulers:
        bad = [f"{d}: {s}" for d, s in l3.schedulers if s != tuning.NVME_SCHEDULER]
        yield Finding(
            "l3.scheduler", "warning" if bad else "ok",
            ", ".join(f"{d}: {s}" for d, s in l3.schedulers), tuning.NVME_SCHEDULER,
            tuning.NVME_SCHEDULER_WHY,
            f"{tuning.ROLE}_nvme_scheduler: none (udev rule); now: "
            + "; ".join(f"echo none > /sys/block/{d}/queue/scheduler" for d, _ in l3.schedulers),
        )  # fmt: skip
    elif l3.device:
        yield Finding(
            "l3.scheduler", "info", f"{l3.device} is not NVMe", "NVMe with scheduler none",
            tuning.NVME_SCHEDULER_WHY, "put L3 on an NVMe drive",
        )  # fmt: skip


def _check_owner(l3: L3Facts, fix_root: str) -> Iterator[Finding]:
    if l3.mode is None:
        return
    fix = f"chown {l3.expected_owner} {l3.path} && chmod 0700 {l3.path} ({fix_root})"
    if l3.mode & stat.S_IWOTH:
        sev = "critical"
    elif l3.mode & 0o077:
        sev = "warning"
    else:
        sev = "ok"
    yield Finding(
        "l3.mode", sev, f"{l3.mode:04o}", f"{tuning.L3_MODE:04o}", tuning.L3_ROOT_WHY, fix
    )
    foreign = l3.uid != l3.expected_uid
    yield Finding(
        "l3.owner", "warning" if foreign else "ok", f"{l3.owner} (uid {l3.uid})",
        f"{l3.expected_owner} (uid {l3.expected_uid})", tuning.L3_ROOT_WHY, fix,
    )  # fmt: skip


def check_pcie(facts: Facts) -> Iterator[Finding]:
    """A GPU and the L3 drive behind one switch or root port; links trained below their max."""
    if not facts.gpus:
        yield Finding(
            "pcie.shared", "ok", "no GPU found", "GPU and L3 drive on separate PCIe paths",
            tuning.PCIE_SHARED_WHY, "nothing to do",
        )  # fmt: skip
    elif facts.topology:
        shared = [t for t in facts.topology if t.contended]
        yield Finding(
            "pcie.shared", "warning" if shared else "ok",
            "; ".join(t.message for t in shared)
            or ", ".join(f"GPU {t.gpu} / {t.device}: {t.level}" for t in facts.topology),
            "GPU and L3 drive on separate PCIe paths", tuning.PCIE_SHARED_WHY,
            "move the L3 drive to a slot under another root port or switch, or limit its "
            f"writes ({tuning.ROLE}_io_write_bandwidth_max)",
        )  # fmt: skip
    for item in facts.links:
        link = item.link
        if link.width is None and link.speed is None:
            continue
        narrow = link.width is not None and link.max_width is not None
        narrow = narrow and link.width < link.max_width  # type: ignore[operator]
        slow = link.downgraded and not narrow
        sev = "warning" if narrow or (slow and item.role == "drive") else "ok"
        if slow and item.role == "gpu":
            sev = "info"  # GPUs lower the link speed when idle; re-check under load
        yield Finding(
            f"pcie.link.{item.role}.{item.bus_id}", sev,
            f"{link.speed} x{link.width}", f"{link.max_speed} x{link.max_width}",
            tuning.PCIE_LINK_WHY,
            "reseat the card or drive, check the riser and the BIOS PCIe generation setting; "
            f"nvidia-smi -q -d PCIE / lspci -vv -s {item.bus_id}",
        )  # fmt: skip


CHECKS = (
    check_sysctl, check_memory, check_l2_ram, check_swap, check_fstrim, check_l3, check_pcie,
)  # fmt: skip


def check(facts: Facts) -> list[Finding]:
    """Every check's findings, in a stable order."""
    return [finding for run in CHECKS for finding in run(facts)]


def exit_code(findings: list[Finding]) -> int:
    """0 healthy, 1 warnings, 2 critical."""
    severities = {f.severity for f in findings}
    return 2 if "critical" in severities else 1 if "warning" in severities else 0
