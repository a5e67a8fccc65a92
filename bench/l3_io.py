"""L3 store throughput against the raw device, measured in the same run, the way kvtier does I/O.

Chunks are 256 tokens of Qwen2-7B geometry (57,344 bytes/token in bf16: 14.7 MB). Every kvtier
figure sits beside a raw ceiling measured right before or after it (the order alternates by
round) on the same bytes at the same concurrency:

- raw write: O_DIRECT sequential writes of whole .kvbin-sized buffers, one fsync per stream at
  the end (one file per stream); raw read: O_DIRECT reads of the same bytes, one chunk per call.
- kvtier write: durable `put` (temp file, fdatasync, rename, directory fsync, index commit),
  single-stream, from S threads at once (as the transfer engine's writer pool calls it), and
  `put_many` batches (writers in flight inside the store).
- kvtier read: verified `get` (header checksum, fingerprint, payload checksum), single-stream and
  from S threads (the transfer engine's reader pool); plus two single-stream ablations: the
  payload checksum off, and the checksum run after the whole read instead of beside it.

Ratios are medians of the per-round ratios, which cancels slow drift of a shared disk.

    PYTHONPATH=. python3 bench/l3_io.py --dir /path/on/the/ssd [--chunks 16] [--streams 4]

With --encrypt it compares an encrypted store (AES-256-GCM, docs/security.md) with a plain one
instead, in the same run and on the same device: durable put and verified get, 1 stream and S
streams, the order alternating by round; the table gives encrypted / plain.

    PYTHONPATH=. python3 bench/l3_io.py --dir /path/on/the/ssd --encrypt

Needs nothing beyond kvtier's own dependencies (without the `crc32c` package it checksums with
zlib's CRC-32, which the table names); matplotlib only for --png.
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
import zlib
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kvtier import kvbin
from kvtier.kvbin import ChunkHeader
from kvtier.tiers.l3 import L3Store
from kvtier.tiers.l3 import io as l3_io

FP = bytes(range(16))
O_DIRECT = getattr(os, "O_DIRECT", 0)


def gbps(nbytes: int, seconds: float) -> float:
    return nbytes / seconds / 1e9 if seconds > 0 else float("nan")


def parallel(streams: int, work: Callable[[int], object]) -> float:
    """Run work(0..streams-1) on that many threads at once; seconds for all of them."""
    t0 = time.perf_counter()
    if streams == 1:
        work(0)
    else:
        with ThreadPoolExecutor(streams) as ex:
            list(ex.map(work, range(streams)))
    return time.perf_counter() - t0


def split(n: int, streams: int) -> list[range]:
    return [range(s, n, streams) for s in range(streams)]


def raw_write(files: list[Path], buf: memoryview, n: int) -> float:
    """Stream s writes its share of n chunk-sized buffers sequentially into files[s] with
    O_DIRECT, then fsyncs: the device's durable-write ceiling at that concurrency."""
    parts = split(n, len(files))

    def work(s: int) -> None:
        fd = os.open(files[s], os.O_WRONLY | os.O_CREAT | os.O_TRUNC | O_DIRECT, 0o600)
        try:
            for _ in parts[s]:
                l3_io.write_all(fd, [buf])
            os.fsync(fd)
        finally:
            os.close(fd)

    return parallel(len(files), work)


def raw_overwrite(path: Path, buf: memoryview, n: int) -> float:
    """O_DIRECT rewrite of an existing file's blocks, then fsync: the device's data-only rate,
    with no block allocation (a new chunk file cannot avoid allocating)."""
    fd = os.open(path, os.O_WRONLY | O_DIRECT)
    t0 = time.perf_counter()
    try:
        for i in range(n):
            l3_io.pwrite_all(fd, [buf], i * len(buf))
        os.fsync(fd)
    finally:
        os.close(fd)
    return time.perf_counter() - t0


def raw_read(files: list[Path], size: int, n: int) -> float:
    """O_DIRECT reads of the same files, one chunk per call, one thread per file."""
    parts = split(n, len(files))
    bufs = [l3_io.aligned_buffer(size) for _ in files]

    def work(s: int) -> None:
        fd = os.open(files[s], os.O_RDONLY | O_DIRECT)
        try:
            for j in range(len(parts[s])):
                l3_io.read_into(fd, [bufs[s][:size]], j * size)
        finally:
            os.close(fd)

    return parallel(len(files), work)


def checksum_rates(algo: str, data: bytes) -> tuple[float, float]:
    """In-memory GB/s of the checksum on one thread and on two (does it release the GIL?)."""

    def run(threads: int) -> float:
        t = parallel(threads, lambda _: [kvbin.checksum(algo, data) for _ in range(4)])
        return gbps(4 * threads * len(data), t)

    return run(1), run(2)


def header(i: int, tokens: int, payload_len: int) -> ChunkHeader:
    return ChunkHeader(
        key=i.to_bytes(16, "big"),
        parent=bytes(16),
        fingerprint=FP,
        tenant="bench",
        tokens=tokens,
        layers=28,
        kv_heads=4,
        head_dim=128,
        dtype="bfloat16",
        codec="native",
        codec_params=b"",
        payload_len=payload_len,
        created=time.time(),
    )


FIGURES = (
    # name, ceiling key, concurrency label
    ("durable write, put", "w1", "1"),
    ("durable write, put from S threads", "wS", "S"),
    ("durable write, put_many xB", "wS", "S"),
    ("read, verified get", "r1", "1"),
    ("read, verified get from S threads", "rS", "S"),
    ("read, payload checksum off", "r1", "1"),
    ("read, checksum after the read (no overlap)", "r1", "1"),
)


def one_round(work: Path, args: argparse.Namespace, rnd: int) -> dict[str, float]:
    """Every measurement once, in a fresh directory; raw before kvtier in even rounds."""
    work.mkdir()
    n, streams = args.chunks, args.streams
    payload_len = args.tokens * args.bytes_per_token
    size = kvbin.file_size(payload_len)
    total = n * size
    src = l3_io.aligned_buffer(size)
    src[: len(PAYLOAD)] = PAYLOAD
    payload = src[:payload_len]  # page-aligned, as pinned L2 slots are: zero-copy O_DIRECT
    one = [work / "raw1.bin"]
    many = [work / f"raw{s}of{streams}.bin" for s in range(streams)]
    out: dict[str, float] = {}
    store = L3Store(work / "l3", io_threads=streams)
    bufs = [store.aligned_buffer(size - kvbin.HEADER_SIZE) for _ in range(streams)]
    keys = iter(range(1 << 30))

    def put_serial() -> float:
        ids = [next(keys) for _ in range(n)]
        t0 = time.perf_counter()
        for i in ids:
            store.put(header(i, args.tokens, payload_len), payload)
        return time.perf_counter() - t0

    def put_threads() -> float:
        ids = [next(keys) for _ in range(n)]
        parts = split(n, streams)

        def work_s(s: int) -> None:
            for j in parts[s]:
                store.put(header(ids[j], args.tokens, payload_len), payload)

        return parallel(streams, work_s)

    def put_batches() -> float:
        ids = [next(keys) for _ in range(n)]
        t0 = time.perf_counter()
        for b in range(0, n, args.batch):
            store.put_many(
                [(header(i, args.tokens, payload_len), payload) for i in ids[b:][: args.batch]]
            )
        return time.perf_counter() - t0

    def get_threads(ids: list[int], threads: int, verify: bool = True) -> float:
        parts = split(len(ids), threads)

        def work_s(s: int) -> None:
            for j in parts[s]:
                store._read(ids[j].to_bytes(16, "big"), bufs[s], fingerprint=FP, verify=verify)

        return parallel(threads, work_s)

    raw_first = rnd % 2 == 0
    pairs: list[tuple[str, Callable[[], float], Callable[[], float]]] = [
        ("w1", lambda: raw_write(one, src, n), put_serial),
        ("wS", lambda: raw_write(many, src, n), put_threads),
        ("wS2", lambda: raw_write(many, src, n), put_batches),
    ]
    for name, raw, kv in pairs:
        for fn, tag in ((raw, "raw"), (kv, "kv")) if raw_first else ((kv, "kv"), (raw, "raw")):
            out[f"{tag}:{name}"] = gbps(total, fn())
    out["raw:w1over"] = gbps(total, raw_overwrite(one[0], src[:size], n))
    ids = [list(range(i * n, (i + 1) * n)) for i in range(3)]
    piece = store.read_piece
    reads: list[tuple[str, Callable[[], float], Callable[[], float]]] = [
        ("r1", lambda: raw_read(one, size, n), lambda: get_threads(ids[0], 1)),
        ("rS", lambda: raw_read(many, size, n), lambda: get_threads(ids[1], streams)),
        ("r1off", lambda: raw_read(one, size, n), lambda: get_threads(ids[2], 1, False)),
    ]
    for name, raw, kv in reads:
        for fn, tag in ((raw, "raw"), (kv, "kv")) if raw_first else ((kv, "kv"), (raw, "raw")):
            out[f"{tag}:{name}"] = gbps(total, fn())
    store.read_piece = 1 << 40  # one read, then the checksum: what the overlap saves

    def serial_get() -> float:
        return get_threads(ids[0], 1)

    for fn, tag in (
        ((lambda: raw_read(one, size, n), "raw"), (serial_get, "kv"))
        if raw_first
        else ((serial_get, "kv"), (lambda: raw_read(one, size, n), "raw"))
    ):
        out[f"{tag}:r1serial"] = gbps(total, fn())
    store.read_piece = piece
    check = memoryview(bytearray(size))
    store.get((n - 1).to_bytes(16, "big"), check, fingerprint=FP)
    if bytes(check[:payload_len]) != PAYLOAD:
        raise SystemExit("read back different bytes")
    st = store.stats()
    STATS.append(
        (
            st.reads_direct,
            st.reads_cached,
            st.reads_buffered,
            store._commit.items,
            store._commit.batches,
        )
    )
    store.close()
    shutil.rmtree(work, ignore_errors=True)
    return out


PAYLOAD = b""
STATS: list[tuple[int, ...]] = []
ENC_FIGURES = (
    ("durable write, put", "w1", False),
    ("durable write, put from S threads", "wS", True),
    ("read, verified get", "r1", False),
    ("read, verified get from S threads", "rS", True),
)


def encrypt_round(work: Path, args: argparse.Namespace, rnd: int) -> dict[str, float]:
    """Durable put and verified get on a plain and an encrypted store side by side (same
    payload, same device, same threads); plain first in even rounds."""
    from kvtier.sealing import MasterKey

    work.mkdir()
    n, streams = args.chunks, args.streams
    payload_len = args.tokens * args.bytes_per_token
    size = kvbin.file_size(payload_len)
    src = l3_io.aligned_buffer(size)
    src[: len(PAYLOAD)] = PAYLOAD
    payload = src[:payload_len]
    stores = {
        "plain": L3Store(work / "plain", io_threads=streams),
        "sealed": L3Store(
            work / "sealed", io_threads=streams, master_key=MasterKey(os.urandom(32))
        ),
    }
    bufs = [l3_io.aligned_buffer(size - kvbin.HEADER_SIZE) for _ in range(streams)]
    # Warm-up, untimed: a serving process's stores are warm (their scratch buffers faulted in,
    # the tenant's data key unwrapped); a fresh store pays that once, which is not the rate.
    for store in stores.values():
        warm = [header((1 << 40) + w, args.tokens, payload_len) for w in range(streams)]
        store.put_many([(h, payload) for h in warm])  # at once: `streams` buffers in use
        store.get(warm[0].key, bufs[0], fingerprint=FP)
    written: dict[tuple[str, str], list[int]] = {}
    out: dict[str, float] = {}
    order = ("plain", "sealed") if rnd % 2 == 0 else ("sealed", "plain")
    for _, fig, many in ENC_FIGURES:
        threads = streams if many else 1
        for mode in order:
            store = stores[mode]
            if fig.startswith("w"):
                ids = list(range(len(written) * n, (len(written) + 1) * n))
                written[(mode, fig)] = ids

                def put_s(
                    s: int, ids: list[int] = ids, store: L3Store = store, threads: int = threads
                ) -> None:
                    for j in split(n, threads)[s]:
                        store.put(header(ids[j], args.tokens, payload_len), payload)

                out[f"{mode}:{fig}"] = gbps(n * size, parallel(threads, put_s))
            else:
                ids = written[(mode, "w" + fig[1:])]

                def get_s(
                    s: int, ids: list[int] = ids, store: L3Store = store, threads: int = threads
                ) -> None:
                    for j in split(n, threads)[s]:
                        store.get(ids[j].to_bytes(16, "big"), bufs[s], fingerprint=FP)

                out[f"{mode}:{fig}"] = gbps(n * size, parallel(threads, get_s))
    for mode, store in stores.items():
        check = l3_io.aligned_buffer(size - kvbin.HEADER_SIZE)
        store.get(written[(mode, "w1")][0].to_bytes(16, "big"), check, fingerprint=FP)
        if bytes(check[:payload_len]) != PAYLOAD:
            raise SystemExit(f"{mode} store read back different bytes")
        store.close()
    shutil.rmtree(work, ignore_errors=True)
    return out


def encrypt_main(work: Path, args: argparse.Namespace) -> None:
    from cryptography.hazmat.primitives.ciphers.aead import AESGCM

    rounds = [encrypt_round(work / f"r{rnd}", args, rnd) for rnd in range(args.rounds)]
    print()
    print(f"| {'figure':36} | streams | plain GB/s | encrypted GB/s | ratio | ratio range |")
    print(f"|{'-' * 38}|---------|------------|----------------|-------|-------------|")
    for name, fig, many in ENC_FIGURES:
        plain = statistics.median(r[f"plain:{fig}"] for r in rounds)
        sealed = statistics.median(r[f"sealed:{fig}"] for r in rounds)
        ratios = [r[f"sealed:{fig}"] / r[f"plain:{fig}"] for r in rounds]
        label = name.replace("S threads", f"{args.streams} threads")
        streams = args.streams if many else 1
        print(
            f"| {label:36} | {streams:7} | {plain:10.2f} | {sealed:14.2f} | "
            f"{statistics.median(ratios):5.2f} | {min(ratios):5.2f}-{max(ratios):<5.2f} |"
        )
    aes = AESGCM(os.urandom(32))
    out = bytearray(len(PAYLOAD) + 16)
    times = []
    for _ in range(5):  # best of five, the output buffer already faulted in
        t0 = time.perf_counter()
        aes.encrypt_into(os.urandom(12), PAYLOAD, b"", out)
        times.append(time.perf_counter() - t0)
    print()
    print(f"AES-256-GCM in memory, 1 thread: seal {gbps(len(PAYLOAD), min(times)):.1f} GB/s")


def main() -> None:
    global PAYLOAD
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--dir", default=None, help="directory on the device to measure (default: tmp)")
    ap.add_argument("--chunks", type=int, default=16, help="chunks per measurement")
    ap.add_argument("--streams", type=int, default=4, help="threads (the cache's l3_threads)")
    ap.add_argument("--batch", type=int, default=8, help="chunks per put_many")
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--bytes-per-token", type=int, default=57_344, help="Qwen2-7B bf16")
    ap.add_argument("--rounds", type=int, default=5, help="repeat and report medians")
    ap.add_argument("--png", default=None, help="write a bar chart here (needs matplotlib)")
    ap.add_argument(
        "--encrypt", action="store_true", help="compare an encrypted store with a plain one"
    )
    args = ap.parse_args()

    base = Path(args.dir) if args.dir else Path(tempfile.gettempdir())
    work = Path(tempfile.mkdtemp(prefix="kvtier-bench-", dir=base))
    probe = work / "probe"
    try:
        os.close(os.open(probe, os.O_WRONLY | os.O_CREAT | O_DIRECT, 0o600))
    except OSError as exc:
        shutil.rmtree(work, ignore_errors=True)
        raise SystemExit(f"{base} refuses O_DIRECT ({exc}): pass --dir on the SSD") from None
    probe.unlink()
    payload_len = args.tokens * args.bytes_per_token
    PAYLOAD = os.urandom(payload_len)
    algo = kvbin.default_checksum()
    print(
        f"# {platform.node()} {platform.machine()} Linux {platform.release()}, "
        f"{os.cpu_count()} CPUs, dir {work}, {args.chunks} chunks x {payload_len / 1e6:.1f} MB "
        f"({args.tokens} tokens x {args.bytes_per_token} B) per figure, S={args.streams} "
        f"streams, B={args.batch}, {args.rounds} rounds, checksum {algo}"
        + ("" if algo == "crc32c" else f" (zlib {zlib.ZLIB_RUNTIME_VERSION})")
    )
    if args.encrypt:
        try:
            encrypt_main(work, args)
        finally:
            shutil.rmtree(work, ignore_errors=True)
        return
    rounds: list[dict[str, float]] = []
    try:
        for rnd in range(args.rounds):
            rounds.append(one_round(work / f"r{rnd}", args, rnd))
    finally:
        shutil.rmtree(work, ignore_errors=True)

    keys = ("w1", "wS", "wS2", "r1", "rS", "r1off", "r1serial")
    rows = []
    for (name, _, conc), key in zip(FIGURES, keys, strict=True):
        kv = statistics.median(r[f"kv:{key}"] for r in rounds)
        raw = statistics.median(r[f"raw:{key}"] for r in rounds)
        ratio = statistics.median(r[f"kv:{key}"] / r[f"raw:{key}"] for r in rounds)
        lo = min(r[f"kv:{key}"] / r[f"raw:{key}"] for r in rounds)
        hi = max(r[f"kv:{key}"] / r[f"raw:{key}"] for r in rounds)
        label = name.replace("S threads", f"{args.streams} threads").replace("xB", f"x{args.batch}")
        streams = args.streams if conc == "S" else 1
        rows.append((label, streams, kv, raw, ratio, lo, hi))
    print()
    print(f"| {'figure':44} | streams | kvtier GB/s | raw O_DIRECT GB/s | ratio | ratio range |")
    print(f"|{'-' * 46}|---------|-------------|-------------------|-------|-------------|")
    for label, streams, kv, raw, ratio, lo, hi in rows:
        print(
            f"| {label:44} | {streams:7} | {kv:11.2f} | {raw:17.2f} | {ratio:5.2f} | "
            f"{lo:5.2f}-{hi:<5.2f} |"
        )
    over = statistics.median(r["raw:w1over"] for r in rounds)
    over_ratio = statistics.median(r["kv:w1"] / r["raw:w1over"] for r in rounds)
    print()
    print(
        f"raw O_DIRECT overwrite of already allocated blocks, 1 stream: {over:.2f} GB/s "
        f"(durable put is {over_ratio:.2f} of it; the table's ceilings write new files)"
    )
    one, two = checksum_rates(algo, PAYLOAD)
    direct, cached, buffered, items, batches = (sum(col) for col in zip(*STATS, strict=True))
    print()
    print(f"checksum {algo} in memory: {one:.1f} GB/s on 1 thread, {two:.1f} GB/s on 2")
    print(f"reads by path: direct {direct}, page cache {cached}, buffered {buffered}")
    print(
        f"group commit: {items} put calls in {batches} commits ({items / batches:.2f} per commit)"
    )
    if args.png:
        plot(rows, args.png)


def plot(rows: list[tuple], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 4))
    ys = range(len(rows))
    ax.barh([y + 0.2 for y in ys], [r[2] for r in rows], 0.4, label="kvtier")
    ax.barh([y - 0.2 for y in ys], [r[3] for r in rows], 0.4, label="raw O_DIRECT, same run")
    ax.set_yticks(list(ys), [r[0] for r in rows])
    ax.invert_yaxis()
    ax.set_xlabel("GB/s")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
