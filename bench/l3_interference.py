"""How much background L3 write-through slows the thread that drives the model.

The serving thread spends a decode step issuing thousands of small torch operations from
Python. This benchmark times such a loop alone (the ceiling) and while the transfer engine
writes 14.7 MB chunks (Qwen2-7B geometry) from L2 slots to L3 in the background, exactly as
write-through does, with the engine's writer threads at normal priority and at background
priority (nice 10, the default).

    python3 bench/l3_interference.py --dir DIR [--seconds 6]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from kvtier.codecs import make_codec
from kvtier.geometry import KVGeometry
from kvtier.kvbin import ChunkHeader
from kvtier.tiers import l3_io
from kvtier.tiers.l2 import HostArena
from kvtier.tiers.l3 import L3Store
from kvtier.transfer import TransferEngine

GEOMETRY = KVGeometry(28, 4, 128, 128, "bfloat16", "gqa")
CHUNK = 256


def step(x: torch.Tensor, ops: int = 3000) -> float:
    """A stand-in for one decode step's Python-side work: many small torch operations."""
    t = time.perf_counter()
    for _ in range(ops):
        x = torch.add(x, 1.0)
    return time.perf_counter() - t


def run(root: Path, seconds: float, background: bool) -> list[float]:
    codec = make_codec("native", GEOMETRY)
    size = codec.payload_bytes(CHUNK)
    arena = HostArena(size, 8 * size, pin=False)
    store = L3Store(root)
    engine = TransferEngine(GEOMETRY, CHUNK, "cpu", arena, store, codec)
    if not background:  # the engine's writer threads at the serving thread's priority
        engine._writer._initializer = None  # type: ignore[attr-defined]
        store_initializer = l3_io.background_thread
        l3_io.background_thread = lambda: None  # type: ignore[assignment]
    slots = [arena.alloc() for _ in range(8)]
    for s in slots:
        arena.view(s).copy_(torch.randint(0, 255, (size,), dtype=torch.uint8))
    stop = threading.Event()

    def feed() -> None:  # keep the write queue busy, as write-through does under load
        i = 0
        while not stop.is_set():
            header = ChunkHeader(
                key=os.urandom(16),
                parent=bytes(16),
                fingerprint=bytes(16),
                tenant="bench",
                tokens=CHUNK,
                layers=28,
                kv_heads=4,
                head_dim=128,
                dtype="bfloat16",
                codec="native",
                codec_params=codec.params(),
                payload_len=size,
                created=time.time(),
            )
            fut = engine.write_l3(slots[i % len(slots)], header)
            if fut is not None:
                fut.result()
            i += 1

    feeders = [threading.Thread(target=feed) for _ in range(2)]
    for f in feeders:
        f.start()
    x = torch.randn(64, 64)
    times = []
    t_end = time.perf_counter() + seconds
    while time.perf_counter() < t_end:
        times.append(step(x))
    stop.set()
    for f in feeders:
        f.join()
    engine.close()
    store.close()
    arena.close()
    if not background:
        l3_io.background_thread = store_initializer  # type: ignore[assignment]
    return times


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--dir", default=None, help="directory on the L3 disk (default: a temp dir)")
    ap.add_argument("--seconds", type=float, default=6.0)
    args = ap.parse_args()
    torch.set_num_threads(1)
    base_dir = Path(args.dir or tempfile.mkdtemp(prefix="kvtier-interf-"))
    x = torch.randn(64, 64)
    alone = statistics.median(step(x) for _ in range(30))
    rows = []
    for background in (False, True):
        root = base_dir / f"bg{int(background)}"
        times = run(root, args.seconds, background)
        rows.append(
            (background, statistics.median(times), sorted(times)[int(0.95 * (len(times) - 1))])
        )
    print(f"\nserving-loop step with L3 write-through in the background ({os.cpu_count()} CPUs)")
    print(
        f"{'writer priority':>16} {'p50 ms':>8} {'p95 ms':>8} {'alone ms':>9} {'p50 / alone':>12}"
    )
    for background, p50, p95 in rows:
        name = "nice 10" if background else "normal"
        print(
            f"{name:>16} {p50 * 1e3:8.2f} {p95 * 1e3:8.2f} {alone * 1e3:9.2f} {p50 / alone:12.2f}"
        )


if __name__ == "__main__":
    main()
