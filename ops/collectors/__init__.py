"""Host collectors: thin readers of /proc, /sys and NVML around the pure parsers in ops.parsers.

`sample()` returns a frozen `HostSnapshot` of every source; rates need the previous snapshot.
"""

from ops.collectors.host import HostSnapshot, sample

__all__ = ["HostSnapshot", "sample"]
