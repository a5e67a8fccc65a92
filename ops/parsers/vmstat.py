"""/proc/vmstat: reclaim, compaction and OOM counters, and the dirty-page thresholds.

Kernel history the parser absorbs: `allocstall` split per zone into `allocstall_<zone>` in 4.10;
`oom_kill` appeared in 4.13; `workingset_refault` split into `_anon` and `_file` in 5.9;
`pgscan_direct` was per zone (`pgscan_direct_normal`, ...) before 4.8.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field


@dataclass(frozen=True)
class Vmstat:
    """Selected counters (events since boot) and thresholds (pages); None when absent."""

    pgmajfault: int | None
    allocstall: int | None  # sum over zones
    compact_stall: int | None
    compact_fail: int | None
    workingset_refault_file: int | None
    pgscan_direct: int | None
    oom_kill: int | None
    nr_dirty: int | None
    nr_writeback: int | None
    nr_dirty_threshold: int | None
    nr_dirty_background_threshold: int | None
    fields: Mapping[str, int] = field(default_factory=dict, compare=False, repr=False)


def _sum_prefixed(values: Mapping[str, int], exact: str, prefix: str) -> int | None:
    if exact in values:
        return values[exact]
    parts = [v for k, v in values.items() if k.startswith(prefix)]
    return sum(parts) if parts else None


def parse(text: str) -> Vmstat:
    """Parse /proc/vmstat (`name value` per line)."""
    values: dict[str, int] = {}
    for line in text.splitlines():
        parts = line.split()
        if len(parts) != 2:
            continue
        try:
            values[parts[0]] = int(parts[1])
        except ValueError:
            continue
    get = values.get
    refault = get("workingset_refault_file", get("workingset_refault"))
    return Vmstat(
        pgmajfault=get("pgmajfault"),
        allocstall=_sum_prefixed(values, "allocstall", "allocstall_"),
        compact_stall=get("compact_stall"),
        compact_fail=get("compact_fail"),
        workingset_refault_file=refault,
        pgscan_direct=_sum_prefixed(values, "pgscan_direct", "pgscan_direct_"),
        oom_kill=get("oom_kill"),
        nr_dirty=get("nr_dirty"),
        nr_writeback=get("nr_writeback"),
        nr_dirty_threshold=get("nr_dirty_threshold"),
        nr_dirty_background_threshold=get("nr_dirty_background_threshold"),
        fields=values,
    )
