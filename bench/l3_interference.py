"""How much background L3 write-through slows the thread that drives the model, and why.

Write-through puts every full chunk to L3 in the background while the serving thread decodes.
This benchmark times a decode step alone (the ceiling) and while 14.7 MB chunks (Qwen2-7B
geometry) are written to L3 in the background the way write-through writes them:

  threads        the transfer engine's writer threads in this process (kvtier's default)
  threads-nice0  the same at normal priority instead of nice 10
  checksum-only  threads that only compute the chunk checksums (no disk I/O)
  process        the same writes from a child process (no shared interpreter)
  writer-process kvtier's L3 writer process (`l3_writer="process"`, the default): the engine
                 in this process, the file writes in a child reading L2 from shared memory
  MODE-pinned    MODE with the decode thread on a core of its own and the background work on
                 the other CPUs (`kvtier.tiers.l3.io.isolate_caller`)

Comparing the rows separates CPU contention, the shared interpreter (GIL) and the disk I/O.
A step is one real decode forward of a Qwen2-shaped model with random weights (`--step model`,
3,000 tokens of context; Qwen2-7B on CUDA) or a stand-in of 3,000 small torch ops (`--step ops`).

    python3 bench/l3_interference.py --dir DIR [--seconds 6] [--step model|ops]
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import statistics
import sys
import tempfile
import threading
import time
import zlib
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from kvtier.codecs import make_codec
from kvtier.geometry import KVGeometry
from kvtier.tiers.l2 import HostArena
from kvtier.tiers.l3 import L3Store
from kvtier.tiers.l3 import io as l3_io
from kvtier.transfer import TransferEngine

GEOMETRY = KVGeometry(28, 4, 128, 128, "bfloat16", "gqa")
CHUNK = 256
FEEDERS = 2  # threads keeping the write queue busy, as write-through does under load


def write_load(
    root: Path, stop: threading.Event, nice: bool, checksum_only: bool, process: bool = False
) -> int:
    """Write chunks through a TransferEngine until `stop`; returns the chunks written."""
    codec = make_codec("native", GEOMETRY)
    size = codec.payload_bytes(CHUNK)
    arena = HostArena(size, 8 * size, pin=False, shared=process)
    slots = [arena.alloc() for _ in range(8)]
    for s in slots:
        arena.view(s).copy_(torch.randint(0, 255, (size,), dtype=torch.uint8))
    if checksum_only:
        written = _feed(stop, nice, lambda i: zlib.crc32(arena.buffer(slots[i % len(slots)])))
        arena.close()
        return written

    saved = l3_io.background_thread
    if not nice:  # the engine's and the store's pools then run at normal priority
        l3_io.background_thread = lambda *args: None  # type: ignore[assignment]
    store = L3Store(root)
    engine = TransferEngine(GEOMETRY, CHUNK, "cpu", arena, store, codec, writer_process=process)
    l3_io.background_thread = saved  # type: ignore[assignment]

    def put(i: int) -> bool:
        header = codec.header(os.urandom(16), CHUNK, fingerprint=bytes(16), tenant="bench")
        fut = engine.write_l3(slots[i % len(slots)], header)
        return fut is not None and fut.result() is not None

    written = _feed(stop, nice, put)
    engine.close()
    store.close()
    arena.close()
    return written


def _feed(stop: threading.Event, nice: bool, work: Callable[[int], object]) -> int:
    """Run work(0), work(1), ... on FEEDERS threads until `stop`; returns the calls that
    returned something true (chunks checksummed or written)."""
    done = [0]

    def loop() -> None:
        l3_io.background_thread(nice)
        i = 0
        while not stop.is_set():
            if work(i):
                done[0] += 1
            i += 1

    threads = [threading.Thread(target=loop) for _ in range(FEEDERS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return done[0]


def _child(root: str, cpus: set | None, ready: mp.Event, stop: mp.Event, result: mp.Queue) -> None:
    torch.set_num_threads(1)
    if cpus:
        os.sched_setaffinity(0, cpus)
    local = threading.Event()
    threading.Thread(target=lambda: (stop.wait(), local.set()), daemon=True).start()
    ready.set()
    result.put(write_load(Path(root), local, nice=True, checksum_only=False))


def measure(step: Callable[[], None], seconds: float, mode: str, root: Path) -> tuple:
    """Step times while `mode`'s background load runs, and the chunks it wrote meanwhile."""
    stop = threading.Event()
    count: list[int] = [0]
    allowed = os.sched_getaffinity(0)
    pinned = l3_io.isolate_caller() if mode.endswith("-pinned") else None
    if mode.endswith("-pinned"):
        print(f"  {mode}: decode thread on CPUs {pinned[0] if pinned else 'any (too few CPUs)'}")
        mode = mode.removesuffix("-pinned")
    if mode == "process":
        ctx = mp.get_context("spawn")
        ready, pstop, result = ctx.Event(), ctx.Event(), ctx.Queue()
        cpus = pinned[1] if pinned else None
        proc = ctx.Process(target=_child, args=(str(root), cpus, ready, pstop, result))
        proc.start()
        ready.wait()
        time.sleep(0.5)  # the child's store is open and writing
    else:
        nice = mode != "threads-nice0"
        load = threading.Thread(
            target=lambda: count.__setitem__(
                0,
                write_load(
                    root,
                    stop,
                    nice,
                    checksum_only=mode == "checksum-only",
                    process=mode == "writer-process",
                ),
            )
        )
        load.start()
        time.sleep(0.5)
    times = []
    t_end = time.perf_counter() + seconds
    while time.perf_counter() < t_end:
        t = time.perf_counter()
        step()
        times.append(time.perf_counter() - t)
    if mode == "process":
        pstop.set()
        count[0] = result.get()
        proc.join()
    else:
        stop.set()
        load.join()
    if pinned:  # undo the isolation for the next mode
        os.sched_setaffinity(0, allowed)
        l3_io.forget_isolation()
    return times, count[0]


def ops_step() -> Callable[[], None]:
    x = torch.randn(64, 64)

    def step() -> None:
        y = x
        for _ in range(3000):
            y = torch.add(y, 1.0)

    return step


def model_step(device: str, context: int) -> tuple[Callable[[], None], str]:
    from models import build, sync
    from transformers import DynamicCache

    cuda = device.startswith("cuda")
    shape = "qwen2-7b" if cuda else "qwen2-mini"
    model = build(shape, device, torch.bfloat16 if cuda else torch.float32)
    cache = DynamicCache(config=model.config)
    ids = torch.randint(100, 30000, (1, context), device=device)
    with torch.no_grad():
        model(ids, past_key_values=cache, logits_to_keep=1)
    tok = ids[:, -1:]

    def step() -> None:
        with torch.no_grad():
            model(tok, past_key_values=cache, logits_to_keep=1)
        sync(device)
        cache.crop(-1)  # drop the new token: same context length every step

    return step, f"{shape} decode step, {context} tokens of context on {device}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--dir", default=None, help="directory on the L3 disk (default: a temp dir)")
    ap.add_argument("--seconds", type=float, default=6.0, help="per mode")
    ap.add_argument("--step", choices=("model", "ops"), default="model")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--context", type=int, default=3000)
    ap.add_argument(
        "--modes",
        default="threads,threads-pinned,writer-process,writer-process-pinned,checksum-only,"
        "process,process-pinned",
    )
    args = ap.parse_args()
    base = Path(args.dir or tempfile.mkdtemp(prefix="kvtier-interf-"))
    if args.step == "model":
        step, what = model_step(args.device, args.context)
    else:
        torch.set_num_threads(1)
        step, what = ops_step(), "3,000 small torch ops on the CPU"
    for _ in range(5):
        step()
    alone = [0.0] * 0
    t_end = time.perf_counter() + min(args.seconds, 4.0)
    while time.perf_counter() < t_end:
        t = time.perf_counter()
        step()
        alone.append(time.perf_counter() - t)
    base_p50 = statistics.median(alone)
    chunk_mb = GEOMETRY.chunk_bytes(CHUNK) / 1e6
    print(f"\n{what}, with L3 write-through in the background ({os.cpu_count()} CPUs)")
    print(f"{'background':>22} {'p50 ms':>8} {'p95 ms':>8} {'p50/alone':>10} {'writes MB/s':>12}")
    print(f"{'none':>22} {base_p50 * 1e3:8.2f} {_p95(alone) * 1e3:8.2f} {1.0:10.2f} {'-':>12}")
    for i, mode in enumerate(args.modes.split(",")):
        times, chunks = measure(step, args.seconds, mode, base / f"{i}-{mode}")
        rate = chunks * chunk_mb / args.seconds
        p50 = statistics.median(times)
        print(
            f"{mode:>22} {p50 * 1e3:8.2f} {_p95(times) * 1e3:8.2f} {p50 / base_p50:10.2f} "
            f"{rate:12.0f}",
            flush=True,
        )


def _p95(values: list[float]) -> float:
    return sorted(values)[int(0.95 * (len(values) - 1))]


if __name__ == "__main__":
    main()
