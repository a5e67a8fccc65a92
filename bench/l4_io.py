"""L4 (Redis) throughput against the same Redis driven raw, in one run, on loopback.

Values are chunks of 256 tokens of Qwen2-7B geometry (57,344 bytes/token in bf16: 14.7 MB of
payload, plus the 4096-byte .kvbin header). The bench starts its own redis-server (no
persistence, a temp dir, a free loopback port) and stops it at the end. Every kvtier figure sits
beside a raw one measured right before or after it (the order alternates by round), with the
same value size and the same number of connections:

- put: `L4Store.put_chunk` (checksum, .kvbin header, SET under a temp key + RENAME in one
  MULTI/EXEC) against a raw redis-py `SET` loop of values of the same size.
- verified get: `L4Store.get_chunks` of one key at a time (GET, header checksum, key,
  fingerprint, tenant and payload checksum, then a copy into a slot-sized buffer) against a raw
  redis-py `GET` loop; and of all keys at once over `--streams` pipelined connections (what a
  restore does) against as many threads each running a raw `GET` loop.
- redis-benchmark's own SET/GET of the same value size (C client), where it is installed: the
  server's ceiling, for reference.

Ratios are medians of the per-round ratios, which cancels slow drift of a shared machine.

    PYTHONPATH=. python3 bench/l4_io.py [--chunks 8] [--rounds 5] [--streams 4]
"""

from __future__ import annotations

import argparse
import os
import platform
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import redis

from kvtier import kvbin
from kvtier.kvbin import ChunkHeader
from kvtier.tiers.l4 import L4Store, keys

FP = bytes(range(16))
PAYLOAD = 57344 * 256  # bytes of one 256-token chunk of Qwen2-7B in bf16


def gbps(nbytes: int, seconds: float) -> float:
    return nbytes / seconds / 1e9 if seconds > 0 else float("nan")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start_redis(root: Path) -> tuple[subprocess.Popen[bytes], int]:
    exe = shutil.which("redis-server")
    if exe is None:
        sys.exit("redis-server is not installed (apt-get install redis-server)")
    port = free_port()
    args = [exe, "--port", str(port), "--bind", "127.0.0.1", "--dir", str(root)]
    args += ["--save", "", "--appendonly", "no", "--protected-mode", "no"]
    proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    r = redis.Redis(port=port)
    for _ in range(200):
        try:
            r.ping()
            return proc, port
        except redis.ConnectionError:
            time.sleep(0.05)
    proc.kill()
    sys.exit("redis-server did not start")


def header(key: bytes) -> ChunkHeader:
    return ChunkHeader(
        key=key,
        parent=bytes(16),
        fingerprint=FP,
        tenant="bench",
        tokens=256,
        layers=28,
        kv_heads=4,
        head_dim=128,
        dtype="bfloat16",
        codec="native",
        codec_params=b"",
        payload_len=PAYLOAD,
        created=time.time(),
    )


def parallel(streams: int, work: Callable[[int], object]) -> float:
    t0 = time.perf_counter()
    if streams == 1:
        work(0)
    else:
        with ThreadPoolExecutor(streams) as ex:
            list(ex.map(work, range(streams)))
    return time.perf_counter() - t0


def one_round(port: int, args: argparse.Namespace, rnd: int) -> dict[str, tuple[float, float]]:
    """{figure: (kvtier GB/s, raw GB/s)} for one round."""
    n, streams = args.chunks, args.streams
    payloads = [os.urandom(PAYLOAD) for _ in range(2)]
    ck = [os.urandom(16) for _ in range(n)]
    value_len = PAYLOAD + kvbin.HEADER_SIZE
    raw_values = [os.urandom(value_len) for _ in range(2)]
    raw = redis.Redis(port=port)
    raws = [redis.Redis(port=port) for _ in range(streams)]
    store1 = L4Store(f"redis://127.0.0.1:{port}/0", ttl_s=3600, streams=1, timeout_s=30)
    storeS = L4Store(f"redis://127.0.0.1:{port}/0", ttl_s=3600, streams=streams, timeout_s=30)
    slots = [bytearray(PAYLOAD) for _ in range(n)]
    total = n * value_len

    def dest(i: int, h: ChunkHeader) -> memoryview:
        return memoryview(slots[i])

    def k_put() -> float:
        t0 = time.perf_counter()
        for i, k in enumerate(ck):
            store1.put_chunk(header(k), payloads[i % 2])
        return time.perf_counter() - t0

    def r_put() -> float:
        t0 = time.perf_counter()
        for i in range(n):
            raw.set(f"raw:{i}", raw_values[i % 2], px=3_600_000)
        return time.perf_counter() - t0

    def k_get() -> float:
        t0 = time.perf_counter()
        for j, k in enumerate(ck):
            b = store1.get_chunks([k], FP, lambda _, h, j=j: dest(j, h), tenants=("bench",))
            b.futures[0].result()
        return time.perf_counter() - t0

    def r_get() -> float:
        t0 = time.perf_counter()
        for i in range(n):
            raw.get(f"raw:{i}")
        return time.perf_counter() - t0

    def k_get_s() -> float:
        t0 = time.perf_counter()
        b = storeS.get_chunks(ck, FP, dest, tenants=("bench",))
        for f in b.futures:
            f.result()
        return time.perf_counter() - t0

    def r_get_s() -> float:
        def work(s: int) -> None:
            for i in range(s, n, streams):
                raws[s].get(f"raw:{i}")

        return parallel(streams, work)

    out: dict[str, tuple[float, float]] = {}
    pairs = [
        ("put, 1 connection", k_put, r_put),
        ("verified get, 1 connection", k_get, r_get),
        (f"verified get, {streams} connections (a restore)", k_get_s, r_get_s),
    ]
    for name, kfn, rfn in pairs:
        if rnd % 2:
            tk, tr = kfn(), rfn()
        else:
            tr, tk = rfn(), kfn()
        out[name] = (gbps(total, tk), gbps(total, tr))
    got = storeS.stats()
    assert got["errors"] == 0 and got["misses"] == 0, got
    for i in range(2):  # the last copies hold the payloads written
        assert bytes(slots[i]) == payloads[i % 2]
    store1.close()
    storeS.close()
    raw.delete(*[keys.chunk(k) for k in ck], *[f"raw:{i}" for i in range(n)])
    return out


def redis_benchmark(port: int, n: int) -> dict[str, float]:
    """redis-benchmark's SET and GET of the same value size, 1 connection: GB/s."""
    exe = shutil.which("redis-benchmark")
    if exe is None:
        return {}
    size = PAYLOAD + kvbin.HEADER_SIZE
    res = subprocess.run(
        [exe, "-p", str(port), "-t", "set,get", "-d", str(size), "-n", str(n), "-c", "1", "-q"],
        capture_output=True,
        text=True,
        timeout=600,
    )
    out = {}
    for line in res.stdout.replace("\r", "\n").splitlines():
        if ":" in line and "requests per second" in line:
            name, rest = line.split(":", 1)
            rps = float(rest.split()[0])
            out[name.strip()] = rps * size / 1e9
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--chunks", type=int, default=8, help="values per figure and round")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--streams", type=int, default=4, help="connections of the parallel read")
    args = ap.parse_args()
    root = Path(tempfile.mkdtemp(prefix="kvtier-l4bench-"))
    proc, port = start_redis(root)
    server = redis.Redis(port=port).info("server")["redis_version"]
    try:
        rounds = [one_round(port, args, r) for r in range(args.rounds)]
        bench = redis_benchmark(port, 4 * args.chunks)
    finally:
        proc.terminate()
        proc.wait(10)
        shutil.rmtree(root, ignore_errors=True)
    algo = kvbin.default_checksum()
    print(
        f"L4 on loopback: {os.cpu_count()} CPUs, {platform.machine()}, "
        f"redis-server {server}, redis-py {redis.__version__}, "
        f"values {(PAYLOAD + kvbin.HEADER_SIZE) / 1e6:.1f} MB, {args.chunks} per figure, "
        f"{args.rounds} rounds, checksum {algo}"
    )
    print()
    print(f"| {'figure':42} | kvtier GB/s | raw redis-py GB/s | ratio | ratio range |")
    print(f"|{'-' * 44}|-------------|-------------------|-------|-------------|")
    for name in rounds[0]:
        ks = [r[name][0] for r in rounds]
        rs = [r[name][1] for r in rounds]
        ratios = [k / r for k, r in zip(ks, rs, strict=True)]
        print(
            f"| {name:42} | {statistics.median(ks):11.2f} | {statistics.median(rs):17.2f} | "
            f"{statistics.median(ratios):5.2f} | {min(ratios):.2f}-{max(ratios):.2f}   |"
        )
    if bench:
        print()
        print(
            "redis-benchmark (C client, 1 connection, same value size): "
            + ", ".join(f"{k} {v:.2f} GB/s" for k, v in bench.items())
        )


if __name__ == "__main__":
    main()
