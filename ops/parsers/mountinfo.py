"""/proc/<pid>/mountinfo: which mount holds a path, for devices st_dev cannot name.

btrfs, overlayfs and other filesystems report an anonymous st_dev (major 0); the mount's
source (`/dev/nvme0n1p2`) then names the block device. Format: proc(5), fields separated by
spaces, optional fields ended by a lone `-`; spaces in paths are escaped as `\\040`.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Mount:
    """One mountinfo line."""

    mount_id: int
    major: int
    minor: int
    root: str
    mount_point: str
    fstype: str
    source: str


def _unescape(text: str) -> str:
    for code, char in (("\\040", " "), ("\\011", "\t"), ("\\012", "\n"), ("\\134", "\\")):
        text = text.replace(code, char)
    return text


def parse(text: str) -> list[Mount]:
    """Parse mountinfo text; malformed lines are skipped."""
    mounts: list[Mount] = []
    for line in text.splitlines():
        parts = line.split()
        try:
            dash = parts.index("-", 6)
            major, minor = (int(n) for n in parts[2].split(":"))
            mounts.append(
                Mount(
                    mount_id=int(parts[0]),
                    major=major,
                    minor=minor,
                    root=_unescape(parts[3]),
                    mount_point=_unescape(parts[4]),
                    fstype=parts[dash + 1],
                    source=_unescape(parts[dash + 2]),
                )
            )
        except (ValueError, IndexError):
            continue
    return mounts


def mount_of(mounts: list[Mount], path: str) -> Mount | None:
    """The mount holding absolute `path`: the longest mount point that prefixes it (last wins)."""
    best: Mount | None = None
    for mount in mounts:
        point = mount.mount_point.rstrip("/") or "/"
        inside = path == point or path.startswith(point.rstrip("/") + "/") or point == "/"
        if inside and (best is None or len(point) >= len(best.mount_point.rstrip("/") or "/")):
            best = mount
    return best
