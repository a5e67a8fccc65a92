"""CPU cost of one host `sample()` (NVML excluded) and of each NVML call, timed separately.

    PYTHONPATH=. python3 bench/collectors.py [--l3 DIR] [--files N] [--rounds N]

The ceiling is the cost of only reading the same files (open + read, no parsing), measured in
the same run: the ratio says how much parsing and resolving add on top of the unavoidable I/O.
The target for a full sample is 5 ms of CPU. Without `--l3`, a temporary store of `--files`
chunk files in the `{hot,cold}/<2 hex>/` layout is made and removed afterwards.
"""

from __future__ import annotations

import argparse
import functools
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

from ops.collectors import disk, nvml, pagecache, pcie, proc, sample

TARGET_MS = 5.0
PROC_FILES = [
    "/proc/buddyinfo",
    "/proc/meminfo",
    "/proc/vmstat",
    "/proc/pressure/memory",
    "/proc/pressure/io",
    "/proc/pressure/cpu",
    "/proc/diskstats",
    "/proc/self/io",
]


def cpu_ms(fn: Callable[[], Any], rounds: int) -> float:
    """Mean CPU time (user + system) of one call, in milliseconds."""
    fn()  # warm caches and imports
    start = time.process_time()
    for _ in range(rounds):
        fn()
    return (time.process_time() - start) / rounds * 1000


def wall_us(fn: Callable[[], Any], rounds: int) -> float:
    fn()
    start = time.perf_counter()
    for _ in range(rounds):
        fn()
    return (time.perf_counter() - start) / rounds * 1e6


def raw_read(paths: list[str]) -> None:
    for path in paths:
        try:
            with open(path, "rb") as f:
                f.read()
        except OSError:
            pass


def make_store(root: str, files: int) -> None:
    payload = os.urandom(64 * 1024)
    for i in range(files):
        tier = "hot" if i % 4 else "cold"
        shard = os.path.join(root, tier, f"{i % 256:02x}")
        os.makedirs(shard, exist_ok=True)
        with open(os.path.join(shard, f"{i:08x}.kvbin"), "wb") as f:
            f.write(payload)


def chunk_paths(root: str, limit: int) -> list[str]:
    out: list[str] = []
    for dirpath, _dirs, names in sorted(os.walk(root)):
        out.extend(os.path.join(dirpath, n) for n in sorted(names) if n.endswith(".kvbin"))
        if len(out) >= limit:
            break
    return out[:limit]


def table(rows: list[tuple[str, float, float | None]]) -> None:
    print(f"{'figure':<34}{'CPU ms/call':>12}{'ceiling ms':>12}{'ratio':>8}{'target ms':>11}")
    for name, value, ceiling in rows:
        ratio = f"{value / ceiling:.1f}" if ceiling else "-"
        ceil = f"{ceiling:.3f}" if ceiling is not None else "-"
        target = f"{TARGET_MS:.1f}" if name.startswith("sample(") else "-"
        print(f"{name:<34}{value:>12.3f}{ceil:>12}{ratio:>8}{target:>11}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--l3", help="an existing L3 root (default: a temporary store)")
    parser.add_argument("--files", type=int, default=2000, help="chunk files in the temp store")
    parser.add_argument("--rounds", type=int, default=200)
    args = parser.parse_args()
    tmp = None
    l3 = args.l3
    if l3 is None:
        tmp = tempfile.mkdtemp(prefix="kvtier-bench-")
        l3 = tmp
        make_store(l3, args.files)
    try:
        rounds = args.rounds
        device = disk.device_of(l3)
        sampled = chunk_paths(l3, 64)
        raw_all = cpu_ms(lambda: raw_read(PROC_FILES + sampled), rounds)
        rows = [
            (
                "buddyinfo",
                cpu_ms(proc.read_buddyinfo, rounds),
                cpu_ms(lambda: raw_read(PROC_FILES[:1]), rounds),
            ),
            (
                "meminfo",
                cpu_ms(proc.read_meminfo, rounds),
                cpu_ms(lambda: raw_read(PROC_FILES[1:2]), rounds),
            ),
            (
                "vmstat",
                cpu_ms(proc.read_vmstat, rounds),
                cpu_ms(lambda: raw_read(PROC_FILES[2:3]), rounds),
            ),
            (
                "pressure (3 files)",
                cpu_ms(proc.read_pressure, rounds),
                cpu_ms(lambda: raw_read(PROC_FILES[3:6]), rounds),
            ),
            (
                "disk (resolve + diskstats)",
                cpu_ms(lambda: disk.read(l3), rounds),
                cpu_ms(lambda: raw_read(PROC_FILES[6:7]), rounds),
            ),
            (
                f"page cache ({len(sampled)} files)",
                cpu_ms(lambda: pagecache.read(l3), rounds),
                cpu_ms(lambda: raw_read(sampled), rounds),
            ),
            ("PCIe topology", cpu_ms(lambda: pcie.read_topology(l3, device=device), rounds), None),
        ]
        first = sample(l3, nvml=False)
        rows.append(
            (
                "sample(nvml=False)",
                cpu_ms(lambda: sample(l3, nvml=False, previous=first), rounds),
                raw_all,
            )
        )
        print(
            f"host: {os.uname().release}, {os.cpu_count()} CPUs; L3 store: {l3}"
            f" ({f'temporary, {args.files} files' if tmp else 'given'}); {rounds} rounds"
        )
        print(
            f"page cache method: {'cachestat' if pagecache.HAVE_CACHESTAT else 'mincore'};"
            f" ceiling = open+read of the same files, no parsing"
        )
        table(rows)
        full = rows[-1][1]
        print(
            f"\nsample() without NVML: {full:.3f} ms CPU, target {TARGET_MS} ms:"
            f" {'met' if full <= TARGET_MS else 'NOT met'}"
        )
        count = nvml.device_count()
        if not count:
            print("NVML: no GPU or driver here; run this on a GPU machine for NVML timings")
            return 0
        print(f"\nNVML, {count} GPU(s): wall microseconds per call on GPU 0")
        handle = nvml.nvml_query("nvmlDeviceGetHandleByIndex", 0)
        lib = sys.modules["pynvml"]
        print(f"{'call':<40}{'us/call':>10}")
        for key, (fn_name, extra, _unit) in nvml.FIELDS.items():
            call_args = nvml._memory_args(lib, handle) if key == "memory" else (handle, *extra)
            us = wall_us(functools.partial(nvml.nvml_query, fn_name, *call_args), 50)
            print(f"{key + ' (' + fn_name + ')':<40}{us:>10.1f}")
        print(f"{'read() of all GPUs':<40}{wall_us(nvml.read, 20):>10.1f}")
        print(f"{'sample(nvml=True) CPU ms':<40}{cpu_ms(lambda: sample(l3), 20):>10.3f}")
    finally:
        if tmp:
            shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
