"""The recommended host settings of a kvtier host: the one source of truth.

See docs/architecture.md, "Host tuning".

The Ansible role's defaults (ansible/roles/kvtier_host/defaults/main.yml) are generated from this
module (`python -m ops.tuning > ansible/roles/kvtier_host/defaults/main.yml`, checked by a test)
and `kvtier doctor` compares the running host with the same values. Each value carries its
reason. This module is pure: no I/O, so both sides can import it anywhere.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass

from kvtier import haproxy

KIB = 1024
MIB = 1024 * KIB
GIB = 1024 * MIB

ROLE = "kvtier_host"
HAPROXY_CONFIG = "/etc/haproxy/haproxy.cfg"  # Debian's haproxy package reads this file
FLEET_WHY = (
    "The fleet part: install HAProxy (Debian's package) and write its configuration from the "
    "template `kvtier fleet haproxy-config` renders (kvtier/haproxy.cfg.j2): sessions stick to a "
    "host by a consistent hash of X-Session-ID, /readyz takes a host out. Off by default; turn it "
    "on for the host(s) that route (docs/deploy.md)."
)
ROLE_DEFAULTS_PATH = "ansible/roles/kvtier_host/defaults/main.yml"

# ---- the recommended values, each with its reason -----------------------------------------------

VFS_CACHE_PRESSURE = 50
VFS_CACHE_PRESSURE_WHY = (
    "vm.vfs_cache_pressure sets how eagerly the kernel reclaims the dentry and inode caches (not "
    "the page cache). L3 keeps one file per chunk, so a lookup that misses the dentry cache costs "
    "extra metadata reads on every restore; 50 keeps them longer. 0 never reclaims them and can "
    "end in an OOM."
)
DIRTY_RATIO = 10
DIRTY_RATIO_WHY = (
    "Writers block once dirty pages reach vm.dirty_ratio percent of memory. With many GB of RAM "
    "the kernel default (20) lets a flush of tens of GB stall the SQLite index and logs; 10 caps "
    "the stall."
)
DIRTY_BACKGROUND_RATIO = 5
DIRTY_BACKGROUND_RATIO_WHY = (
    "Background writeback starts at vm.dirty_background_ratio percent; starting at 5 keeps "
    "writeback steady instead of in bursts that compete with L3 restores for the drive. It must "
    "stay below vm.dirty_ratio."
)
HUGEPAGE_KB = 2048
HUGEPAGES_WHY = (
    "L2 is one pinned slab arena allocated at start; backing it with huge pages (vm.nr_hugepages, "
    "reserved early, before memory fragments) cuts TLB misses and pinning time. The count is "
    "ceil(L2 bytes / huge page size)."
)
HUGETLBFS_MOUNT = "/var/lib/kvtier/hugepages"
HUGETLBFS_WHY = "A hugetlbfs mount lets the L2 arena map its huge pages from a file."
L2_RAM_HEADROOM_BYTES = 256 * MIB  # kvtier.tiers.l2.HEADROOM_BYTES: RAM L2 leaves spare
L2_RAM_WHY = (
    "L2 is allocated whole at start, in host RAM that never swaps: the server refuses to start "
    "(BudgetError) when L2 plus headroom exceeds the memory available, and an L2 near all of "
    "the host's memory leaves none for the model's weights as they load, L3's page cache and "
    "the rest of the host."
)
MEMLOCK_HEADROOM_BYTES = 1 * GIB
MEMLOCK_WHY = (
    "The L2 arena is page-locked (mlock / pinned); RLIMIT_MEMLOCK must cover all of L2 plus "
    "headroom for staging buffers, or the cache refuses to start (BudgetError)."
)
THP_MODE = "madvise"
THP_WHY = (
    "Transparent huge pages in 'always' mode make page faults compact memory synchronously and "
    "khugepaged scan every process: latency spikes on a long-running host. 'madvise' keeps THP for "
    "the programs that ask for it; L2 uses explicit huge pages anyway."
)
NVME_SCHEDULER = "none"
NVME_SCHEDULER_WHY = (
    "NVMe drives have deep hardware queues; a software I/O scheduler only adds CPU cost and "
    "latency to the 4 KiB-aligned O_DIRECT chunk reads. 'none' is the right scheduler for NVMe."
)
FSTRIM_POLICY = "offpeak"
FSTRIM_POLICIES = ("offpeak", "disabled", "default")
FSTRIM_ONCALENDAR = "Sun *-*-* 04:00:00"
FSTRIM_RANDOMIZED_DELAY = "30min"
FSTRIM_WHY = (
    "A trim pass stalls I/O for seconds, so the folk recipe disables fstrim.timer; but an SSD "
    "that never learns which blocks are free slowly loses write speed and endurance. Keep the "
    "weekly trim and move it to an off-peak window."
)
L3_ROOT = "/var/lib/kvtier/l3"
L3_MODE = 0o700
L3_ROOT_WHY = (
    "L3 files hold other tenants' KV (prompt contents can be recovered from it): only the service "
    "user may read or write the L3 root, which must be owned by it with mode 0700."
)
L3_FREE_WARNING_RATIO = 0.15
L3_FREE_CRITICAL_RATIO = 0.05
L3_FREE_CRITICAL_BYTES = 1 * GIB
L3_FREE_WHY = (
    "An SSD with little free space writes slower (garbage collection) and L3 writes start "
    "failing with ENOSPC; keep at least 15% of the filesystem free."
)
L3_BAD_FILESYSTEMS = {
    "tmpfs": "critical",
    "ramfs": "critical",
    "overlay": "warning",
    "aufs": "warning",
}
L3_FILESYSTEM_WHY = (
    "tmpfs/ramfs hold L3 in RAM (it vanishes on reboot and takes memory from L2); overlayfs is a "
    "container's writable layer: slow, copy-up on write, lost with the container. Put L3 on a "
    "local SSD filesystem (ext4, xfs)."
)
O_DIRECT_WHY = (
    "L3 reads and writes use O_DIRECT into the pinned L2 slots; without it every chunk is copied "
    "through the page cache twice and evicts other data."
)
PCIE_SHARED_WHY = (
    "A GPU and the L3 drive behind the same PCIe switch or root port share its uplink: L3 "
    "restores then compete with the host-to-GPU copies of the same restores."
)
PCIE_LINK_WHY = (
    "A link trained below its maximum width or speed (bad riser, dirty slot, BIOS setting) caps "
    "every copy through it. GPUs lower the link speed when idle: re-check a speed finding under "
    "load; a narrower width is always a fault."
)
SERVICE = "kvtier"
SLICE = "kvtier.slice"
IO_LIMIT_WHY = (
    "Write-through traffic to L3 can starve the reads of restores. Limit it with systemd's "
    "IOWriteBandwidthMax / IOReadBandwidthMax on the serving unit's slice (persistent), not by "
    "writing io.max into cgroupfs (lost at reboot). Empty means no limit; set it to about 60% of "
    "the drive's measured sequential write bandwidth, e.g. '1500M'."
)


def nr_hugepages(l2_bytes: int, hugepage_kb: int = HUGEPAGE_KB) -> int:
    """Huge pages needed to back an L2 arena of `l2_bytes` (rounded up to whole pages)."""
    if l2_bytes < 0 or hugepage_kb <= 0:
        raise ValueError(
            f"l2_bytes must be >= 0 and hugepage_kb > 0, got {l2_bytes}, {hugepage_kb}"
        )
    return math.ceil(l2_bytes / (hugepage_kb * KIB))


def memlock_bytes(l2_bytes: int) -> int:
    """The RLIMIT_MEMLOCK (LimitMEMLOCK) recommended for an L2 arena of `l2_bytes`."""
    return l2_bytes + MEMLOCK_HEADROOM_BYTES


def sysctl_values(l2_bytes: int, hugepages: bool = True) -> dict[str, int]:
    """The sysctl settings the role writes to /etc/sysctl.d/90-kvtier.conf, in file order."""
    return {
        "vm.vfs_cache_pressure": VFS_CACHE_PRESSURE,
        "vm.dirty_ratio": DIRTY_RATIO,
        "vm.dirty_background_ratio": DIRTY_BACKGROUND_RATIO,
        "vm.nr_hugepages": nr_hugepages(l2_bytes) if hugepages else 0,
    }


# ---- the role's defaults, generated from the values above -----------------------------------------


@dataclass(frozen=True)
class RoleVar:
    """One variable of the kvtier_host role: its default and why it has that value."""

    name: str
    default: object
    why: str


def _v(name: str, default: object, why: str) -> RoleVar:
    return RoleVar(f"{ROLE}_{name}", default, why)


ROLE_VARS: tuple[RoleVar, ...] = (
    _v("root", "", "Prefix of every managed path; '' is the real root. Tests converge into a dir."),
    _v(
        "live",
        True,
        "Run live actions (sysctl --system, udevadm trigger, daemon-reload, mount, user "
        "creation). Off when converging into a directory.",
    ),
    _v("hugepages", True, HUGEPAGES_WHY),
    _v("hugepage_size_kb", HUGEPAGE_KB, "The kernel's default huge page size (Hugepagesize)."),
    _v(
        "nr_hugepages",
        "{{ (kvtier_host_l2_bytes | int / 1024 / kvtier_host_hugepage_size_kb) "
        "| round(0, 'ceil') | int if kvtier_host_hugepages else 0 }}",
        "ceil(L2 bytes / huge page size), as ops.tuning.nr_hugepages computes it.",
    ),
    _v("hugetlbfs_mount", HUGETLBFS_MOUNT, HUGETLBFS_WHY),
    _v("hugetlbfs_mode", "1770", "Mode of the hugetlbfs root (service group may share it)."),
    _v("vfs_cache_pressure", VFS_CACHE_PRESSURE, VFS_CACHE_PRESSURE_WHY),
    _v("dirty_ratio", DIRTY_RATIO, DIRTY_RATIO_WHY),
    _v("dirty_background_ratio", DIRTY_BACKGROUND_RATIO, DIRTY_BACKGROUND_RATIO_WHY),
    _v("memlock_headroom_bytes", MEMLOCK_HEADROOM_BYTES, MEMLOCK_WHY),
    _v(
        "memlock_bytes",
        "{{ (kvtier_host_l2_bytes | int) + (kvtier_host_memlock_headroom_bytes | int) }}",
        "LimitMEMLOCK of the service: L2 plus headroom, as ops.tuning.memlock_bytes computes it.",
    ),
    _v("service", SERVICE, "The serving unit (kvtier.service) that gets the drop-in."),
    _v("slice", SLICE, "The slice the serving unit runs in; it carries the IO limits."),
    _v("user", "kvtier", "The service user that owns the L3 root."),
    _v("group", "kvtier", "The service group."),
    _v("create_user", True, "Create the service user and group (a live action)."),
    _v("l3_root", L3_ROOT, L3_ROOT_WHY),
    _v("l3_device", "", "Block device under the L3 root (e.g. /dev/nvme0n1) for the IO limits."),
    _v("io_read_bandwidth_max", "", IO_LIMIT_WHY),
    _v("io_write_bandwidth_max", "", IO_LIMIT_WHY),
    _v("nvme_scheduler", NVME_SCHEDULER, NVME_SCHEDULER_WHY),
    _v("fstrim", FSTRIM_POLICY, FSTRIM_WHY + " One of offpeak, disabled, default."),
    _v("fstrim_oncalendar", FSTRIM_ONCALENDAR, "The off-peak window (systemd OnCalendar)."),
    _v("fstrim_randomized_delay", FSTRIM_RANDOMIZED_DELAY, "Spreads a fleet's trims apart."),
    _v("fleet", False, FLEET_WHY),
    _v(
        "fleet_hosts",
        [],
        "The kvtier serve hosts behind HAProxy, 'host:port' each (the fleet part).",
    ),
    _v("fleet_config", HAPROXY_CONFIG, "HAProxy's configuration file (the fleet part)."),
    _v("fleet_bind", haproxy.DEFAULTS["bind"], "HAProxy's listen address (the fleet part)."),
    _v("fleet_check_ms", haproxy.DEFAULTS["check_ms"], "Period of the /readyz health checks (ms)."),
    _v("fleet_fall", haproxy.DEFAULTS["fall"], "Failed checks that take a host out."),
    _v("fleet_rise", haproxy.DEFAULTS["rise"], "Good checks that put a host back."),
    _v("fleet_timeout_s", haproxy.DEFAULTS["timeout_s"], "The longest request (seconds)."),
    _v(
        "fleet_stats_bind",
        haproxy.DEFAULTS["stats_bind"],
        "Where HAProxy also serves its stats page and /metrics, e.g. ':8404' ('' for nowhere).",
    ),
)


def role_defaults() -> dict[str, object]:
    """The role defaults as a mapping (what defaults/main.yml must load to)."""
    return {var.name: var.default for var in ROLE_VARS}


def _wrap(text: str, width: int = 98) -> list[str]:
    lines: list[str] = []
    line = "#"
    for word in text.split():
        if len(line) + 1 + len(word) > width:
            lines.append(line)
            line = "#"
        line += " " + word
    lines.append(line)
    return lines


def render_role_defaults() -> str:
    """defaults/main.yml as text: one commented variable per reason. JSON scalars are YAML."""
    out = [
        "---",
        "# Generated from ops/tuning.py (the one source of truth); do not edit by hand:",
        f"#   python -m ops.tuning > {ROLE_DEFAULTS_PATH}",
        "# kvtier_host_l2_bytes (the L2 arena size in bytes) has no default: set it per host.",
    ]
    for var in ROLE_VARS:
        out.append("")
        out.extend(_wrap(var.why))
        out.append(f"{var.name}: {json.dumps(var.default)}")
    return "\n".join(out) + "\n"


if __name__ == "__main__":
    print(render_role_defaults(), end="")
