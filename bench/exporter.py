"""Scrape time of the standalone exporter with 1,000 sessions and 100,000 L3 chunks.

Builds a real L3 store (chunk files written and fsynced through L3Store.put_many, sessions in its
SQLite index), opens it read-only as `kvtier exporter` does, and times full scrapes
(generate_latest over the cache view + host collectors). Target: < 50 ms per scrape.
The ceiling measured in the same run is the floor a scrape cannot beat: the index's own
totals query (L3Store.stats: count and size of every chunk row).

    python3 bench/exporter.py [--chunks 100000] [--sessions 1000] [--root DIR] [--png FILE]
"""

from __future__ import annotations

import argparse
import hashlib
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from prometheus_client import generate_latest

from kvtier.kvbin import ChunkHeader
from kvtier.tiers.l3 import L3Store, SessionRecord
from ops.exporter.standalone import build


def fill(root: Path, chunks: int, sessions: int) -> float:
    fp = hashlib.blake2b(b"bench-model", digest_size=16).digest()
    keys = [
        hashlib.blake2b(i.to_bytes(8, "little"), digest_size=16).digest() for i in range(chunks)
    ]
    payload = bytes(4096)
    t0 = time.perf_counter()
    with L3Store(root) as store:
        have = store.stats().chunks
        if have < chunks:
            for start in range(have, chunks, 2000):
                store.put_many(
                    [
                        (
                            ChunkHeader(
                                key=k,
                                parent=bytes(16),
                                fingerprint=fp,
                                tenant="bench",
                                tokens=16,
                                layers=1,
                                kv_heads=1,
                                head_dim=64,
                                dtype="float32",
                                codec="native",
                                codec_params=b"",
                                payload_len=len(payload),
                                created=time.time(),
                            ),
                            payload,
                        )
                        for k in keys[start : start + 2000]
                    ]
                )
        per = chunks // sessions
        for i in range(sessions):
            store.save_session(
                SessionRecord(
                    session_id=f"s{i}",
                    tenant="bench",
                    fingerprint=fp,
                    token_ids=bytes(4 * 16 * per),
                    chunk_keys=tuple(keys[i * per : (i + 1) * per]),
                    pinned=False,
                    ttl_s=None,
                    last_active=time.time(),
                    state=("hibernated", "idle", "active")[i % 3],
                )
            )
    return time.perf_counter() - t0


def timed(fn, n: int) -> list[float]:
    out = []
    for _ in range(n):
        t = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--chunks", type=int, default=100_000)
    ap.add_argument("--sessions", type=int, default=1_000)
    ap.add_argument("--scrapes", type=int, default=30)
    ap.add_argument("--root", type=Path, help="store directory (kept; reused when it exists)")
    ap.add_argument("--png", type=Path)
    args = ap.parse_args()
    tmp = None
    if args.root is None:
        tmp = tempfile.TemporaryDirectory(prefix="kvtier-bench-")
        args.root = Path(tmp.name)
    print(f"filling {args.root}: {args.chunks} chunks, {args.sessions} sessions ...", flush=True)
    print(f"  filled in {fill(args.root, args.chunks, args.sessions):.1f} s")

    registry, store = build(args.root, nvml=False)
    generate_latest(registry)  # warm: first sample has no previous snapshot
    scrape = timed(lambda: generate_latest(registry), args.scrapes)
    floor = timed(lambda: store.stats(), args.scrapes)
    store.close()

    p50, p99 = statistics.median(scrape), max(scrape)
    c50 = statistics.median(floor)
    print()
    print(f"{'figure':<44}{'value':>12}{'ceiling':>12}{'ratio':>8}")
    print(f"{'scrape, median (ms)':<44}{p50 * 1e3:>12.1f}{c50 * 1e3:>12.1f}{p50 / c50:>8.2f}")
    print(
        f"{'scrape, worst of ' + str(args.scrapes) + ' (ms)':<44}{p99 * 1e3:>12.1f}{'':>12}{'':>8}"
    )
    print(f"{'target (ms)':<44}{50.0:>12.1f}")
    print(
        "ceiling = the index totals query every scrape needs (L3Store.stats), same store, same run"
    )
    print("verdict:", "PASS" if p50 < 0.050 else "FAIL", f"(median {p50 * 1e3:.1f} ms vs 50 ms)")
    if args.png:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(6, 3))
        ax.plot([x * 1e3 for x in scrape], label="scrape")
        ax.plot([x * 1e3 for x in floor], label="index totals (floor)")
        ax.axhline(50, color="red", linestyle="--", label="target")
        ax.set_xlabel("scrape")
        ax.set_ylabel("ms")
        ax.legend()
        fig.tight_layout()
        fig.savefig(args.png)
        print(f"wrote {args.png}")
    if tmp is not None:
        tmp.cleanup()


if __name__ == "__main__":
    main()
