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

`--cluster` runs the same figures on a Redis Cluster of 3 masters and 3 replicas the bench starts
itself (`redis-server --cluster-enabled`, joined by `redis-cli --cluster create`): kvtier through
`L4Store("redis+cluster://...")`, raw through redis-py's `RedisCluster`. Each raw value sits in
the same hash slot as its kvtier chunk (same hash tag), so both sides load the same shards. The
parallel read splits each shard's keys in up to `--streams` parts, run `--streams` at a time,
on both sides (as `L4Store` does).

Ratios are medians of the per-round ratios, which cancels slow drift of a shared machine.

    PYTHONPATH=. python3 bench/l4_io.py [--chunks 8] [--rounds 5] [--streams 4] [--cluster]
"""

from __future__ import annotations

import argparse
import os
import platform
import random
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
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import redis
from redis.cluster import RedisCluster

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


def free_cluster_port() -> int:
    """A free loopback port whose cluster bus port (+10000) is free too."""
    for _ in range(200):
        port = random.randrange(20000, 55535)
        try:
            with socket.socket() as a, socket.socket() as b:
                a.bind(("127.0.0.1", port))
                b.bind(("127.0.0.1", port + 10000))
            return port
        except OSError:
            continue
    sys.exit("no free port pair for a cluster node")


def start_cluster(root: Path, masters: int = 3) -> tuple[list[subprocess.Popen[bytes]], int]:
    """`masters` masters and as many replicas on loopback, each a `redis-server
    --cluster-enabled yes` (no persistence), joined by `redis-cli --cluster create`; returns
    the processes and one node's port once every node says cluster_state:ok."""
    exe, cli = shutil.which("redis-server"), shutil.which("redis-cli")
    if exe is None or cli is None:
        sys.exit("redis-server and redis-cli are not installed (apt-get install redis-server)")
    procs: list[subprocess.Popen[bytes]] = []
    ports: list[int] = []
    try:
        for i in range(2 * masters):
            port = free_cluster_port()
            node = root / f"node{i}"
            node.mkdir()
            args = [exe, "--port", str(port), "--bind", "127.0.0.1", "--dir", str(node)]
            args += ["--save", "", "--appendonly", "no", "--protected-mode", "no"]
            args += ["--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf"]
            procs.append(
                subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            )
            ports.append(port)
        for port in ports:
            wait_ping(port)
        made = subprocess.run(
            [cli, "--cluster", "create", *(f"127.0.0.1:{p}" for p in ports),
             "--cluster-replicas", "1", "--cluster-yes"],
            capture_output=True, text=True, timeout=60,
        )  # fmt: skip
        if made.returncode != 0:
            raise RuntimeError(f"redis-cli --cluster create failed:\n{made.stdout}{made.stderr}")
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            infos = [redis.Redis(port=p).cluster("info") for p in ports]
            roles = [redis.Redis(port=p).role()[0] for p in ports]
            ok = all(i["cluster_state"] == "ok" for i in infos)
            if ok and sum(r in (b"slave", "slave") for r in roles) == masters:
                return procs, ports[0]
            time.sleep(0.1)
        raise RuntimeError("the cluster is not ok in 30 s")
    except BaseException:
        stop(procs)
        raise


def wait_ping(port: int) -> None:
    r = redis.Redis(port=port)
    for _ in range(200):
        try:
            r.ping()
            return
        except redis.ConnectionError:
            time.sleep(0.05)
    raise RuntimeError(f"redis-server on port {port} did not start")


def stop(procs: list[subprocess.Popen[bytes]]) -> None:
    for proc in procs:
        proc.terminate()
    for proc in procs:
        proc.wait(10)


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


def parallel(streams: int, work: Callable[[int], object], parts: int | None = None) -> float:
    """Seconds to run `work(0..parts-1)` (`parts` defaults to `streams`) on `streams` threads."""
    t0 = time.perf_counter()
    if streams == 1 and (parts or 1) == 1:
        work(0)
    else:
        with ThreadPoolExecutor(streams) as ex:
            list(ex.map(work, range(parts or streams)))
    return time.perf_counter() - t0


def one_round(port: int, args: argparse.Namespace, rnd: int) -> dict[str, tuple[float, float]]:
    """{figure: (kvtier GB/s, raw GB/s)} for one round."""
    n, streams = args.chunks, args.streams
    payloads = [os.urandom(PAYLOAD) for _ in range(2)]
    ck = [os.urandom(16) for _ in range(n)]
    value_len = PAYLOAD + kvbin.HEADER_SIZE
    raw_values = [os.urandom(value_len) for _ in range(2)]
    if args.cluster:
        url = f"redis+cluster://127.0.0.1:{port}"
        raw: Any = RedisCluster(host="127.0.0.1", port=port)  # thread-safe: a pool per node
        raws: list[Any] = [raw] * streams
        rkeys = [f"raw:{{{k.hex()}}}" for k in ck]  # in the slot of chunk i (same hash tag)
        # the parts of the kvtier read: each shard's keys in up to `streams` parts, run by
        # `streams` threads, as L4Store groups them (kvtier.tiers.l4.routes.Cluster.groups)
        by_node: dict[str, list[int]] = {}
        for i, k in enumerate(rkeys):
            by_node.setdefault(raw.get_node_from_key(k).name, []).append(i)
        rgroups = [g[j :: min(streams, len(g))] for g in by_node.values()
                   for j in range(min(streams, len(g)))]  # fmt: skip
    else:
        url = f"redis://127.0.0.1:{port}/0"
        raw = redis.Redis(port=port)
        raws = [redis.Redis(port=port) for _ in range(streams)]
        rkeys = [f"raw:{i}" for i in range(n)]
        rgroups = [list(range(s, n, streams)) for s in range(streams)]
    store1 = L4Store(url, ttl_s=3600, streams=1, timeout_s=30)
    storeS = L4Store(url, ttl_s=3600, streams=streams, timeout_s=30)
    if args.cluster:  # the slot maps and a connection to each primary, before any clock runs
        store1.ping()
        storeS.ping()
        raw.ping(target_nodes=RedisCluster.PRIMARIES)
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
        for i, k in enumerate(rkeys):
            raw.set(k, raw_values[i % 2], px=3_600_000)
        return time.perf_counter() - t0

    def k_get() -> float:
        t0 = time.perf_counter()
        for j, k in enumerate(ck):
            b = store1.get_chunks([k], FP, lambda _, h, j=j: dest(j, h), tenants=("bench",))
            b.futures[0].result()
        return time.perf_counter() - t0

    def r_get() -> float:
        t0 = time.perf_counter()
        for k in rkeys:
            raw.get(k)
        return time.perf_counter() - t0

    def k_get_s() -> float:
        t0 = time.perf_counter()
        b = storeS.get_chunks(ck, FP, dest, tenants=("bench",))
        for f in b.futures:
            f.result()
        return time.perf_counter() - t0

    def r_get_s() -> float:
        def work(s: int) -> None:
            for i in rgroups[s]:
                raws[s % streams].get(rkeys[i])

        return parallel(streams, work, len(rgroups))

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
    for name in [keys.chunk(k) for k in ck] + rkeys:  # one key a call: a cluster's keys spread
        raw.delete(name)
    raw.close()
    return out


def redis_benchmark(port: int, n: int, cluster: bool = False) -> dict[str, float]:
    """redis-benchmark's SET and GET of the same value size, 1 connection: GB/s."""
    exe = shutil.which("redis-benchmark")
    if exe is None:
        return {}
    size = PAYLOAD + kvbin.HEADER_SIZE
    res = subprocess.run(
        [
            exe,
            "-p",
            str(port),
            "-t",
            "set,get",
            "-d",
            str(size),
            "-n",
            str(n),
            "-c",
            "1",
            "-q",
            *(["--cluster"] if cluster else []),
        ],
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
    ap.add_argument("--streams", type=int, default=4,
                    help="connections of the parallel read (per shard with --cluster)")  # fmt: skip
    ap.add_argument("--cluster", action="store_true",
                    help="a Redis Cluster of 3 masters and 3 replicas instead of one server")  # fmt: skip
    args = ap.parse_args()
    root = Path(tempfile.mkdtemp(prefix="kvtier-l4bench-"))
    procs: list[subprocess.Popen[bytes]] = []
    try:
        if args.cluster:
            procs, port = start_cluster(root)
        else:
            proc, port = start_redis(root)
            procs = [proc]
        server = redis.Redis(port=port).info("server")["redis_version"]
        rounds = [one_round(port, args, r) for r in range(args.rounds)]
        bench = redis_benchmark(port, 4 * args.chunks, args.cluster)
    finally:
        stop(procs)
        shutil.rmtree(root, ignore_errors=True)
    algo = kvbin.default_checksum()
    where = "a Redis Cluster (3 masters, 3 replicas)" if args.cluster else "one redis-server"
    print(
        f"L4 on loopback, {where}: {os.cpu_count()} CPUs, {platform.machine()}, "
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
            f"redis-benchmark (C client, 1 connection{', --cluster' if args.cluster else ''}, "
            "same value size): " + ", ".join(f"{k} {v:.2f} GB/s" for k, v in bench.items())
        )


if __name__ == "__main__":
    main()
