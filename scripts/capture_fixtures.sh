#!/usr/bin/env bash
# Capture this host's /proc and /sys pieces that the collectors read, as a fixture tree.
#
#   scripts/capture_fixtures.sh DESTDIR [DIR ...]
#
# DESTDIR/proc/...   buddyinfo, meminfo, vmstat, zoneinfo, pressure/*, diskstats, mountinfo
# DESTDIR/sys/...    the readlink -f targets of /sys/bus/pci/devices/*, /sys/block/*,
#                    /sys/dev/block/*, /sys/class/nvme*/* rebuilt as directories, with the
#                    links themselves as relative symlinks, so DESTDIR/sys works as a sys root;
#                    each PCI device keeps class, vendor, device and its PCIe link attributes
# DESTDIR/stat_dev.txt  "<major>:<minor> <dir>" for / and each DIR
#                       (give the L3 root here), the st_dev a collector resolves
# DESTDIR/nvml.json  every NVML reading per GPU (when pynvml and a driver are present)
# DESTDIR/uname.txt  kernel release and machine
# DESTDIR/debugfs/extfrag/*  the kernel's unusable and fragmentation indices, when readable
#
# Needs only bash and python3 (pynvml optional). Reads, never writes, /proc and /sys.
set -euo pipefail

if [[ $# -lt 1 ]]; then
    echo "usage: $0 DESTDIR [DIR ...]   (DIR: directories whose block device to record, e.g. the L3 root)" >&2
    exit 2
fi
DEST=$1
shift
REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
mkdir -p "$DEST/proc/pressure" "$DEST/proc/self"

for f in buddyinfo meminfo vmstat zoneinfo diskstats pagetypeinfo; do
    if [[ -r /proc/$f ]]; then
        cat "/proc/$f" >"$DEST/proc/$f" 2>/dev/null || rm -f "$DEST/proc/$f"
    fi
done
for f in memory io cpu irq; do
    if [[ -r /proc/pressure/$f ]]; then
        cat "/proc/pressure/$f" >"$DEST/proc/pressure/$f" 2>/dev/null || rm -f "$DEST/proc/pressure/$f"
    fi
done
# The kernel's own fragmentation indices (debugfs, root only, when debugfs is mounted), with a
# buddyinfo read that matches them: retried until buddyinfo is the same before and after.
python3 - "$DEST" <<'PY'
import os, sys
dest = sys.argv[1]
base = "/sys/kernel/debug/extfrag"
def read(path):
    with open(path) as f:
        return f.read()
try:
    for _ in range(50):
        before = read("/proc/buddyinfo")
        files = {name: read(os.path.join(base, name)) for name in ("unusable_index", "extfrag_index")}
        if read("/proc/buddyinfo") == before:
            os.makedirs(os.path.join(dest, "debugfs", "extfrag"), exist_ok=True)
            for name, text in files.items():
                with open(os.path.join(dest, "debugfs", "extfrag", name), "w") as f:
                    f.write(text)
            with open(os.path.join(dest, "proc", "buddyinfo"), "w") as f:
                f.write(before)
            break
except OSError:
    pass
PY
# Only mounts of real block devices (major != 0): pseudo and tmpfs mounts carry nothing the
# collectors use and would leak host-private mount points into the fixture.
awk '$3 !~ /^0:/' /proc/self/mountinfo >"$DEST/proc/self/mountinfo"
uname -rm >"$DEST/uname.txt"

: >"$DEST/stat_dev.txt"
for d in / "$@"; do
    if dev=$(python3 -c 'import os, sys; s = os.stat(sys.argv[1]); print(f"{os.major(s.st_dev)}:{os.minor(s.st_dev)}")' "$d"); then
        echo "$dev $d" >>"$DEST/stat_dev.txt"
    fi
done

python3 - "$DEST/sys" <<'PY'
"""Rebuild the sysfs links the collectors follow, with the attributes they read."""
import glob
import os
import sys

dest = sys.argv[1]
PCI_ATTRS = ("class", "vendor", "device", "subsystem_vendor", "subsystem_device", "numa_node",
             "current_link_speed", "current_link_width", "max_link_speed", "max_link_width")
BLOCK_ATTRS = ("dev", "partition", "size", "removable", "queue/rotational",
               "queue/logical_block_size", "queue/scheduler", "queue/nr_requests")
NVME_ATTRS = ("model", "transport", "address", "dev")


def copy_attrs(real_dir, names):
    for name in names:
        src = os.path.join(real_dir, name)
        try:
            with open(src, "rb") as f:
                data = f.read(65536)
        except OSError:
            continue
        out = dest + src[len("/sys"):]
        os.makedirs(os.path.dirname(out), exist_ok=True)
        with open(out, "wb") as f:
            f.write(data)


def mirror_link(link):
    """Create DESTDIR/sys/<link> as a relative symlink to the mirrored target directory."""
    target = os.path.realpath(link)
    if not target.startswith("/sys/"):
        return None
    out_target = dest + target[len("/sys"):]
    os.makedirs(out_target, exist_ok=True)
    out_link = dest + link[len("/sys"):]
    os.makedirs(os.path.dirname(out_link), exist_ok=True)
    if os.path.islink(out_link) or os.path.exists(out_link):
        return target
    os.symlink(os.path.relpath(out_target, os.path.dirname(out_link)), out_link)
    return target


def pci_ancestors(target):
    """Every PCI function directory on the path to `target` (bridges, root ports)."""
    parts = target.split("/")
    for i in range(len(parts)):
        d = "/".join(parts[: i + 1])
        if os.path.exists(os.path.join(d, "class")) and os.path.exists(os.path.join(d, "vendor")):
            yield d


for link in sorted(glob.glob("/sys/bus/pci/devices/*")):
    target = mirror_link(link)
    if target:
        for d in pci_ancestors(target):
            copy_attrs(d, PCI_ATTRS)

block_links = sorted(glob.glob("/sys/block/*") + glob.glob("/sys/dev/block/*"))
nvme_links = sorted(glob.glob("/sys/class/nvme/*") + glob.glob("/sys/class/nvme-subsystem/*"))
for link in block_links + nvme_links:
    target = mirror_link(link)
    if not target:
        continue
    copy_attrs(target, BLOCK_ATTRS + NVME_ATTRS)
    for d in pci_ancestors(target):
        copy_attrs(d, PCI_ATTRS)
    # The disk's `device` link, a multipath subsystem's per-controller links (nvme0, ...),
    # and the member drives (`slaves`) of device-mapper and md devices.
    subs = [os.path.join(target, "device")] + glob.glob(os.path.join(target, "slaves", "*"))
    subs += glob.glob(os.path.join(os.path.dirname(target), "nvme[0-9]*"))
    for sub in subs:
        if os.path.islink(sub):
            sub_target = mirror_link(sub)
            if sub_target:
                copy_attrs(sub_target, BLOCK_ATTRS + NVME_ATTRS)
                for d in pci_ancestors(sub_target):
                    copy_attrs(d, PCI_ATTRS)
    # Partitions: record the whole disk's directory too (the parent of a partition).
    if os.path.exists(os.path.join(target, "partition")):
        copy_attrs(os.path.dirname(target), BLOCK_ATTRS)
PY

if python3 -c 'import pynvml' 2>/dev/null; then
    if ! PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}" python3 -c 'from ops.collectors.nvml import main; main()' >"$DEST/nvml.json" 2>"$DEST/nvml.err"; then
        echo "NVML dump failed; see $DEST/nvml.err" >&2
    fi
    [[ -s $DEST/nvml.err ]] || rm -f "$DEST/nvml.err"
fi
echo "captured into $DEST"
