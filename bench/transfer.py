"""Transfer benchmark: kvtier's copies beside the raw copy ceilings measured in the same run.

Qwen2-7B geometry (28 layers, 4 KV heads of 128, bf16, 256-token chunks), 2K and 8K-token
sessions. Figures: offload (L1 -> L2), restore (L2 -> L1), both at once, and SSD -> L1 through
the L3 store. Ceilings: a pinned 1 GiB copy each way, both ways at once on two streams, and a raw
O_DIRECT read of the same bytes from the same directory with as many threads as the engine's L3
pool; beside each ceiling, the same copy made once over just the figure's bytes. Each call is
waited for as the cache waits for a restore (`Handle.wait(spin=True)`). On a machine without
CUDA the L1 "device" is the CPU and the ceilings are memcpy (one thread; two for "both").

    PYTHONPATH=. python3 bench/transfer.py --out DIR [--dir L3DIR] [--sessions 2048,8192]
        [--groups auto]   (chunks per staging group; a list gives one set of rows each)

Needs only torch (numpy comes with it); writes DIR/transfer.txt and, with matplotlib, a PNG.
"""

from __future__ import annotations

import argparse
import os
import platform
import shutil
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

import torch

from kvtier.codecs import make_codec
from kvtier.geometry import KVGeometry
from kvtier.tiers.l1 import L1Pool
from kvtier.tiers.l2 import HostArena
from kvtier.transfer import TransferEngine

QWEN2_7B = KVGeometry(28, 4, 128, 128, "bfloat16", "gqa")
CHUNK = 256
GIB = 1 << 30
THREADS = 4  # L3 read threads, for the engine and the raw-read ceiling alike


def timed(fn: Callable[[], object], sync: Callable[[], None], reps: int) -> float:
    """Best wall time of `reps` runs of fn (after one warm-up run)."""
    fn()
    sync()
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        sync()
        best = min(best, time.perf_counter() - t0)
    return best


def both(a: Callable[[], object], b: Callable[[], object]) -> Callable[[], None]:
    """Run a and b at once (b in a second thread) and return when both are done."""

    def run() -> None:
        t = threading.Thread(target=b)
        t.start()
        a()
        t.join()

    return run


class Bench:
    def __init__(self, device: torch.device, l3dir: Path, reps: int, max_tokens: int) -> None:
        self.device = device
        self.cuda = device.type == "cuda"
        self.reps = reps
        self.l3dir = l3dir
        self.codec = make_codec("native", QWEN2_7B)
        slot = self.codec.payload_bytes(CHUNK)
        self.chunks = -(-max_tokens // CHUNK)
        # Two sessions' worth: one going down while the other comes up.
        self.arena = HostArena(slot, 2 * self.chunks * slot)
        self.group: int | None = None
        self.engine = self.make_engine(None)
        self.l1 = L1Pool(QWEN2_7B, 1 << 40, device, CHUNK)  # accounting only: never exceeded
        self.blocks: dict[int, torch.Tensor | None] = {}
        # figure, bytes, GB/s, 1 GiB ceiling, what the ceiling is, same-size copy ceiling
        self.rows: list[tuple[str, int, float, float, str, float]] = []
        # figure, host ms to issue, GPU ms from the first copy to the last, total ms
        self.launch: list[tuple[str, float, float, float]] = []

    def make_engine(self, store: object) -> TransferEngine:
        return TransferEngine(
            QWEN2_7B,
            CHUNK,
            self.device,
            self.arena,
            store,
            self.codec,
            l3_threads=THREADS,
            group_chunks=self.group,
        )

    def use_group(self, group: int | None) -> None:
        """Replace the engine by one that moves `group` chunks per staging group."""
        self.engine.close()
        self.group = group
        self.engine = self.make_engine(None)

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize(self.device)

    def layers(self, tokens: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Session buffers as the cache allocates them (L1Pool: one block, per-layer views)."""
        bufs = self.l1.allocate(tokens)
        for k, v in bufs.layers:
            k.normal_()
            v.normal_()
        self.blocks[id(bufs.layers)] = bufs.block  # passed along as the cache does
        return bufs.layers

    def block(self, layers: list) -> torch.Tensor | None:
        return self.blocks.get(id(layers))

    # ---- ceilings ----------------------------------------------------------------------------

    def ceilings(self, n: int = GIB) -> dict[str, float]:
        """n-byte copies between pinned host buffers and the device, each way and both at once
        (one copy call each, timed to its completion like kvtier's calls)."""
        host_a = torch.empty(n, dtype=torch.uint8, pin_memory=self.cuda)
        host_b = torch.empty(n, dtype=torch.uint8, pin_memory=self.cuda)
        dev_a = torch.ones(n, dtype=torch.uint8, device=self.device)
        dev_b = torch.ones(n, dtype=torch.uint8, device=self.device)
        host_a.fill_(1)
        host_b.fill_(1)
        if self.cuda:
            s1, s2 = torch.cuda.Stream(self.device), torch.cuda.Stream(self.device)

            def h2d() -> None:
                with torch.cuda.stream(s1):
                    dev_a.copy_(host_a, non_blocking=True)

            def d2h() -> None:
                with torch.cuda.stream(s2):
                    host_b.copy_(dev_b, non_blocking=True)

            def pair() -> None:
                h2d()
                d2h()

        else:

            def h2d() -> None:
                dev_a.copy_(host_a)

            def d2h() -> None:
                host_b.copy_(dev_b)

            pair = both(h2d, d2h)
        up = n / timed(h2d, self.sync, self.reps)
        down = n / timed(d2h, self.sync, self.reps)
        duplex = 2 * n / timed(pair, self.sync, self.reps)
        return {"h2d": up, "d2h": down, "both": duplex, "bytes": n}

    def disk_ceiling(self, nbytes: int) -> float:
        """Raw O_DIRECT read of nbytes from a file in the L3 directory into the arena."""
        path = self.l3dir / "ceiling.bin"
        slots = list(range(min(self.arena.n_slots, -(-nbytes // self.arena.slot_bytes))))
        fd = os.open(path, os.O_CREAT | os.O_WRONLY | os.O_TRUNC | os.O_DIRECT, 0o600)
        try:
            for i, s in enumerate(slots):
                os.pwritev(fd, [self.arena.buffer(s)], i * self.arena.slot_bytes)
            os.fsync(fd)
        finally:
            os.close(fd)

        def read() -> None:
            fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
            try:
                threads = []
                for part in range(THREADS):
                    mine = slots[part::THREADS]

                    def work(mine: list[int] = mine) -> None:
                        for s in mine:
                            os.preadv(fd, [self.arena.buffer(s)], s * self.arena.slot_bytes)

                    threads.append(threading.Thread(target=work))
                for t in threads:
                    t.start()
                for t in threads:
                    t.join()
            finally:
                os.close(fd)

        seconds = timed(read, lambda: None, self.reps)
        path.unlink()
        return len(slots) * self.arena.slot_bytes / seconds

    # ---- kvtier's paths ----------------------------------------------------------------------

    def session(self, tokens: int, ceil: dict[str, float], tag: str, ssd: bool) -> None:
        chunks = -(-tokens // CHUNK)
        src, dst = self.layers(tokens), self.layers(tokens)
        down = list(range(chunks))
        up = list(range(self.chunks, self.chunks + chunks))
        nbytes = QWEN2_7B.chunk_bytes(tokens)
        eng = self.engine
        sb, db = self.block(src), self.block(dst)
        eng.offload_range(src, 0, tokens, up, block=sb).wait()  # the restore's source

        def offload() -> None:
            eng.offload_range(src, 0, tokens, down, block=sb).wait(spin=True)

        def restore() -> None:
            eng.restore_range(up, tokens, dst, 0, block=db).wait(spin=True)

        if self.cuda:

            def duplex() -> None:
                a = eng.offload_range(src, 0, tokens, down, block=sb)
                b = eng.restore_range(up, tokens, dst, 0, block=db)
                a.wait(spin=True)
                b.wait(spin=True)

        else:
            duplex = both(offload, restore)
        label = f"{tokens / 1024:g}K{tag}"
        same = self.ceilings(nbytes)  # one raw copy of the session's bytes: the per-call floor
        off = nbytes / timed(offload, self.sync, self.reps)
        res = nbytes / timed(restore, self.sync, self.reps)
        dup = 2 * nbytes / timed(duplex, self.sync, self.reps)
        for i in range(QWEN2_7B.num_layers):  # the restored bytes are the offloaded ones
            assert torch.equal(src[i][0], dst[i][0]) and torch.equal(src[i][1], dst[i][1])
        down_what, up_what, both_what = (
            ("pinned D2H", "pinned H2D", "both copies")
            if self.cuda
            else ("memcpy", "memcpy", "two memcpy threads")
        )
        self.rows.append(
            (f"offload L1->L2 {label}", nbytes, off, ceil["d2h"], down_what, same["d2h"])
        )
        self.rows.append(
            (f"restore L2->L1 {label}", nbytes, res, ceil["h2d"], up_what, same["h2d"])
        )
        self.rows.append(
            (f"both at once {label}", 2 * nbytes, dup, ceil["both"], both_what, same["both"])
        )
        self.time_launch(
            f"offload {label}",
            ("l1", "l2"),
            lambda: eng.offload_range(src, 0, tokens, down, block=sb),
        )
        self.time_launch(
            f"restore {label}",
            ("l2", "l1"),
            lambda: eng.restore_range(up, tokens, dst, 0, block=db),
        )
        if ssd:
            self.ssd(tokens, src, ceil, tag)

    def gpu_seconds(self, direction: tuple[str, str]) -> float:
        """The engine's own event-timed seconds in `direction` so far."""
        for t in self.engine.stats().transfers:
            if (t.src, t.dst) == direction:
                return t.seconds
        return 0.0

    def time_launch(
        self, name: str, direction: tuple[str, str], issue: Callable[[], object]
    ) -> None:
        """Host time to issue one call, the GPU time from its first copy to its last (the
        engine's events), and the total: is the host, the device side or the copy the limit?"""
        issue()
        self.sync()
        before = self.gpu_seconds(direction)
        t0 = time.perf_counter()
        issue()
        t1 = time.perf_counter()
        self.sync()
        t2 = time.perf_counter()
        span = self.gpu_seconds(direction) - before
        self.launch.append((name, (t1 - t0) * 1e3, span * 1e3, (t2 - t0) * 1e3))

    def ssd(
        self,
        tokens: int,
        src: list[tuple[torch.Tensor, torch.Tensor]],
        ceil: dict[str, float],
        tag: str,
    ) -> None:
        """SSD -> L1: O_DIRECT reads of .kvbin files into slots (THREADS threads) with the
        restore issued at once: each chunk goes up as soon as its read has landed."""
        try:
            from kvtier.tiers.l3 import L3Store
        except ImportError as exc:
            self.rows.append((f"SSD->L1 {tokens / 1024:g}K (skipped: {exc})", 0, 0.0, 1.0, "", 1.0))
            return
        label = f"{tokens / 1024:g}K{tag}"
        chunks = -(-tokens // CHUNK)
        root = Path(tempfile.mkdtemp(prefix="kvtier-bench-", dir=self.l3dir))
        store = L3Store(root)
        eng = self.make_engine(store)
        slots = list(range(chunks))
        fingerprint = b"B" * 16
        eng.offload_range(src, 0, tokens, slots, block=self.block(src)).wait()
        keys = []
        for i, slot in enumerate(slots):
            n = min(CHUNK, tokens - i * CHUNK)
            key = (tokens * 1000 + i).to_bytes(16, "big")
            header = self.codec.header(key, n, fingerprint=fingerprint, tenant="bench")
            fut = eng.write_l3(slot, header)
            assert fut is not None
            keys.append(key)
        eng.flush()
        dst = self.layers(tokens)

        def load() -> None:
            for k, s in zip(keys, slots, strict=True):
                eng.read_l3(k, s, fingerprint)
            # the L3 reads land first; then wait as the cache does before a forward
            eng.restore_range(slots, tokens, dst, 0, block=self.block(dst)).wait(spin=True)

        nbytes = QWEN2_7B.chunk_bytes(tokens)
        rate = nbytes / timed(load, self.sync, self.reps)
        disk = self.disk_ceiling(nbytes)
        for i in range(QWEN2_7B.num_layers):
            assert torch.equal(src[i][0], dst[i][0]) and torch.equal(src[i][1], dst[i][1])
        self.rows.append((f"SSD->L1 {label}", nbytes, rate, disk, "O_DIRECT read", disk))
        eng.close()
        store.close()
        shutil.rmtree(root)  # hundreds of MB of .kvbin files; only the table is kept


def machine(device: torch.device) -> str:
    if device.type == "cuda":
        return f"{torch.cuda.get_device_name(device)}, {os.cpu_count()} CPUs"
    return f"CPU only ({platform.processor() or platform.machine()}, {os.cpu_count()} CPUs)"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="directory for the table and PNG")
    parser.add_argument("--dir", type=Path, default=None, help="L3 directory (default: --out)")
    parser.add_argument("--sessions", default="2048,8192", help="session sizes in tokens")
    parser.add_argument(
        "--groups", default="auto", help="chunks per staging group: a list of numbers or auto"
    )
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    l3dir = args.dir or args.out
    l3dir.mkdir(parents=True, exist_ok=True)
    sizes = [int(s) for s in args.sessions.split(",")]
    device = torch.device(args.device)
    groups = [None if g == "auto" else int(g) for g in args.groups.split(",")]
    bench = Bench(device, l3dir, args.reps, max(sizes))
    ceil = bench.ceilings()
    staging: dict[int, int] = {}
    for n, group in enumerate(groups):
        bench.use_group(group)
        chosen = bench.engine.group_chunks
        staging[chosen] = bench.engine.staging_bytes
        tag = f" G={chosen}" if len(groups) > 1 else ""
        for tokens in sizes:
            bench.session(tokens, ceil, tag, ssd=n == 0)
    gb = 1e9
    lines = [
        f"kvtier transfer benchmark on {machine(device)}; torch {torch.__version__}",
        f"geometry Qwen2-7B ({QWEN2_7B.bytes_per_token} B/token), chunks of {CHUNK} tokens "
        f"({QWEN2_7B.chunk_bytes(CHUNK)} B), L2 pinned={bench.arena.pinned}, "
        f"ceilings over {ceil['bytes'] / GIB:.2f} GiB, best of {args.reps}, "
        f"{THREADS} L3 threads",
        "staging group (chunks) and the engine's staging memory: "
        + ", ".join(f"G={g}: {b / 1e6:.0f} MB" for g, b in staging.items()),
        "",
        "ceiling: the same copy over 1 GiB; same-size: one raw copy call of the figure's bytes",
        f"{'figure':26} {'bytes':>11} {'GB/s':>8} {'ceiling GB/s':>13} {'ratio':>6} "
        f"{'same-size GB/s':>15} {'ratio':>6}  ceiling",
    ]
    for name, nbytes, rate, ceiling, what, same in bench.rows:
        lines.append(
            f"{name:26} {nbytes:>11} {rate / gb:>8.2f} {ceiling / gb:>13.2f} "
            f"{rate / ceiling:>6.2f} {same / gb:>15.2f} {rate / same:>6.2f}  {what}"
        )
    lines += [
        "",
        f"{'one call':32} {'issue ms':>9} {'GPU span ms':>12} {'total ms':>9}",
    ]
    for name, issue, span, total in bench.launch:
        lines.append(f"{name:32} {issue:>9.2f} {span:>12.2f} {total:>9.2f}")
    text = "\n".join(lines)
    print(text)
    (args.out / "transfer.txt").write_text(text + "\n")
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("(matplotlib not installed: no PNG)")
    else:
        rows = [r for r in bench.rows if r[1]]
        fig, ax = plt.subplots(figsize=(9, 4))
        x = range(len(rows))
        ax.bar([i - 0.2 for i in x], [r[2] / gb for r in rows], 0.4, label="kvtier")
        ax.bar([i + 0.2 for i in x], [r[3] / gb for r in rows], 0.4, label="ceiling")
        ax.set_xticks(list(x), [r[0] for r in rows], rotation=30, ha="right", fontsize=8)
        ax.set_ylabel("GB/s")
        ax.set_title(f"kvtier transfers, Qwen2-7B geometry ({machine(device)})", fontsize=9)
        ax.legend()
        fig.tight_layout()
        fig.savefig(args.out / "transfer.png", dpi=120)
    bench.engine.close()
    bench.arena.close()


if __name__ == "__main__":
    main()
