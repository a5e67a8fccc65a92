"""L3 store throughput against the raw device, measured in the same run.

Chunks are 256 tokens of Qwen2-7B geometry (57,344 bytes/token in bf16: 14.7 MB). The table
compares kvtier's durable writes (temp file, fdatasync, rename, directory fsync, index commit)
with a raw sequential O_DIRECT write of the same bytes followed by fsync, and kvtier's verified
O_DIRECT reads with raw sequential O_DIRECT reads of those bytes; plus reads with payload checksum
verification off, to show what checksumming costs.

    python3 bench/l3_io.py --dir /path/on/the/ssd --chunks 32 [--png out.png]

Runs with PYTHONPATH=. on any Python >= 3.10 with no package beyond the standard library
(without the `crc32c` package it checksums with zlib's CRC-32, which the table names).
"""

from __future__ import annotations

import argparse
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kvtier import kvbin
from kvtier.kvbin import ChunkHeader
from kvtier.tiers import l3_io
from kvtier.tiers.l3 import L3Store

FP = bytes(range(16))


def gbps(nbytes: int, seconds: float) -> float:
    return nbytes / seconds / 1e9 if seconds > 0 else float("nan")


def raw_write(path: Path, buf: memoryview, count: int) -> float:
    """Sequential O_DIRECT write of `count` copies of `buf`, then fsync: the device's ceiling."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | getattr(os, "O_DIRECT", 0)
    t0 = time.perf_counter()
    fd = os.open(path, flags, 0o600)
    try:
        for _ in range(count):
            l3_io.write_all(fd, [buf])
        os.fsync(fd)
    finally:
        os.close(fd)
    return time.perf_counter() - t0


def raw_read(path: Path, buf: memoryview, count: int) -> float:
    flags = os.O_RDONLY | getattr(os, "O_DIRECT", 0)
    fd = os.open(path, flags)
    t0 = time.perf_counter()
    try:
        for i in range(count):
            l3_io.read_into(fd, [buf], i * len(buf))
    finally:
        os.close(fd)
    return time.perf_counter() - t0


def checksum_rate(algo: str, data: bytes, rounds: int = 5) -> float:
    t0 = time.perf_counter()
    for _ in range(rounds):
        kvbin.checksum(algo, data)
    return gbps(len(data) * rounds, time.perf_counter() - t0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dir", default=None, help="directory on the device to measure (default: tmp)")
    ap.add_argument("--chunks", type=int, default=32, help="chunks per measurement")
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--bytes-per-token", type=int, default=57_344, help="Qwen2-7B bf16")
    ap.add_argument("--batch", type=int, default=8, help="chunks per put_many")
    ap.add_argument("--rounds", type=int, default=3, help="repeat and report medians")
    ap.add_argument("--png", default=None, help="write a bar chart here (needs matplotlib)")
    args = ap.parse_args()

    base = Path(args.dir) if args.dir else Path(tempfile.gettempdir())
    work = Path(tempfile.mkdtemp(prefix="kvtier-bench-", dir=base))
    payload_len = args.tokens * args.bytes_per_token
    size = kvbin.file_size(payload_len)
    n = args.chunks
    payload = os.urandom(payload_len)
    algo = kvbin.default_checksum()
    print(
        f"# {platform.node()} {platform.machine()} Linux {platform.release()}, dir {work}, "
        f"{n} chunks x {payload_len / 1e6:.1f} MB ({args.tokens} tokens x "
        f"{args.bytes_per_token} B), checksum {algo}"
    )
    try:
        aligned = l3_io.aligned_buffer(size)
        aligned[kvbin.HEADER_SIZE : kvbin.HEADER_SIZE + payload_len] = payload
        rows: list[tuple[str, float, float]] = []

        samples: list[tuple[float, ...]] = []
        for rnd in range(args.rounds):
            samples.append(one_round(work / f"r{rnd}", aligned, payload, args))
        med = [statistics.median(col) for col in zip(*samples, strict=True)]
        w_raw, r_raw, w_put, w_many, r_get, r_noverify = med[:6]
        st = LAST_STATS[0]
        rows = [
            ("durable write, put (bytes: staged copy)", w_put, w_raw),
            (f"durable write, put_many x{args.batch} (aligned)", w_many, w_raw),
            ("read, verified (both checksums)", r_get, r_raw),
            ("read, payload checksum off", r_noverify, r_raw),
        ]
        print()
        print(f"| {'figure':42} | kvtier GB/s | raw O_DIRECT GB/s | ratio |")
        print(f"|{'-' * 44}|-------------|-------------------|-------|")
        for name, value, ceiling in rows:
            print(f"| {name:42} | {value:11.2f} | {ceiling:17.2f} | {value / ceiling:5.2f} |")
        print()
        print(
            f"checksum {algo} in memory: {checksum_rate(algo, payload):.1f} GB/s; "
            f"reads by path: direct {st.reads_direct}, page cache {st.reads_cached}, "
            f"buffered {st.reads_buffered}"
        )
        if args.png:
            import matplotlib

            matplotlib.use("Agg")
            import matplotlib.pyplot as plt

            fig, ax = plt.subplots(figsize=(8, 3.5))
            labels = [r[0] for r in rows]
            ys = range(len(rows))
            ax.barh([y + 0.2 for y in ys], [r[1] for r in rows], 0.4, label="kvtier")
            ax.barh([y - 0.2 for y in ys], [r[2] for r in rows], 0.4, label="raw O_DIRECT")
            ax.set_yticks(list(ys), labels)
            ax.set_xlabel("GB/s")
            ax.legend()
            fig.tight_layout()
            fig.savefig(args.png, dpi=120)
            print(f"wrote {args.png}")
    finally:
        shutil.rmtree(work, ignore_errors=True)


LAST_STATS: list = [None]


def one_round(
    work: Path, aligned: memoryview, payload: bytes, args: argparse.Namespace
) -> tuple[float, ...]:
    """One pass of every measurement, raw first, in a fresh directory."""
    work.mkdir()
    payload_len = len(payload)
    size = kvbin.file_size(payload_len)
    n = args.chunks
    total = n * size
    raw_path = work / "raw.bin"
    w_raw = gbps(total, raw_write(raw_path, aligned, n))
    r_raw = gbps(total, raw_read(raw_path, aligned, n))
    raw_path.unlink()

    def header(i: int) -> ChunkHeader:
        return ChunkHeader(
            key=i.to_bytes(16, "big"),
            parent=bytes(16),
            fingerprint=FP,
            tenant="bench",
            tokens=args.tokens,
            layers=28,
            kv_heads=4,
            head_dim=128,
            dtype="bfloat16",
            codec="native",
            codec_params=b"",
            payload_len=payload_len,
            created=time.time(),
        )

    with L3Store(work / "l3") as store:
        t0 = time.perf_counter()
        for i in range(n):
            store.put(header(i), payload)
        w_put = gbps(total, time.perf_counter() - t0)
        t0 = time.perf_counter()
        for start in range(n, 2 * n, args.batch):
            batch = range(start, min(2 * n, start + args.batch))
            aligned_payload = aligned[kvbin.HEADER_SIZE : kvbin.HEADER_SIZE + payload_len]
            store.put_many([(header(i), aligned_payload) for i in batch])
        w_many = gbps(total, time.perf_counter() - t0)

        out = store.aligned_buffer(size - kvbin.HEADER_SIZE)
        t0 = time.perf_counter()
        for i in range(n):
            store.get(i.to_bytes(16, "big"), out, fingerprint=FP)
        r_get = gbps(total, time.perf_counter() - t0)
        if bytes(out[:payload_len]) != payload:
            raise SystemExit("read back different bytes")
        t0 = time.perf_counter()
        for i in range(n, 2 * n):
            store._read(i.to_bytes(16, "big"), out, fingerprint=FP, verify=False)
        r_noverify = gbps(total, time.perf_counter() - t0)
        st = store.stats()

    LAST_STATS[0] = st
    shutil.rmtree(work, ignore_errors=True)
    return (w_raw, r_raw, w_put, w_many, r_get, r_noverify)


if __name__ == "__main__":
    main()
