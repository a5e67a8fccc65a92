"""Where a thread's time goes: sample its Python stack every millisecond (`--stacks`).

A poor man's sampling profiler for one named thread (the batch scheduler, "kvtier-batch"),
in the benchmark's own process. Every sample records two things: the scheduler method the
thread is in (the frame below its loop) and the innermost line it is on. A thread that
waits on the device or for the GIL is counted where it waits, so the table reads as wall time.
The report also gives the CPU every thread of the process used meanwhile, in cores (user and
system time; a thread that spins in a device wait counts, and so does the handing over of the
GIL, so the threads' sum can pass 1 even where only one of them runs Python at a time).

`tail_report` splits the scheduler thread's samples by the step whose interval they fall in
(from the end of the step before to the end of this one): what the thread did in the slowest
steps (above the window's P90) against the typical ones (at or below its P50), in milliseconds
per step, so a line that only the slow steps have stands out.

Two things a stack sample cannot see are timed beside it. The sampler needs the GIL to take a
sample, so while one thread holds it (a long C call that keeps it, a garbage collection) no
thread is sampled at all. So the sampler times every garbage collection (`gc.callbacks`), and
every wait of its own past `GAP` seconds, charged to the line each busy thread of the process
was on when the wait ended (the GIL's holder is among them, on the line it just left). Both
are also given per step in `tail_report`.

At the end (`stop`) it takes a census of what a full collection walks: the collector's tracked
objects outside `gc.freeze()` by type, the references each type holds, and one timed full
collection (`census`). The collections free next to nothing in the serving, so this is their
cost.

With `garbage=True` the collector also keeps what it finds in the window (`gc.DEBUG_SAVEALL`),
and the report counts it by type: the reference cycles the serving makes, which the young
collections must find and free (tensors in them free device memory from inside a collection).
"""

from __future__ import annotations

import bisect
import collections
import dataclasses
import gc
import sys
import threading
import time
from types import FrameType

from kvtier.server.batch.turntrace import thread_cpu

OUTER = ("_iterate", "_main")  # the scheduler's loop: report the frame just inside it
HELPERS = ("kvtier-restore", "kvtier-commit")  # thread pools sampled beside the scheduler
GAP = 0.004  # a wait of the sampler's this much past its interval is a blind spot (_charge_gap)


class StackSampler:
    def __init__(
        self, thread_name: str = "kvtier-batch", interval: float = 0.001, garbage: bool = False
    ) -> None:
        self.thread_name = thread_name
        self.garbage = garbage
        self.garbage_types: collections.Counter[str] = collections.Counter()
        self.garbage_tensor_bytes = 0
        self.interval = interval
        self.methods: collections.Counter[str] = collections.Counter()
        self.lines: collections.Counter[str] = collections.Counter()
        self.samples = 0
        self.timeline: list[tuple[float, str]] = []  # (when, "method > line") of every sample
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="stack-sampler", daemon=True)
        self._cpu: dict[int, float] = {}  # CPU seconds by native thread id at start
        self._cpu_used: dict[int, float] = {}  # ... used from start to stop
        self._wall = 0.0
        self._names: dict[int | None, str] = {}  # thread names by native id, at stop
        # per helper pool (thread name prefix): busy samples by "kvtier frame > innermost line"
        self.helpers: dict[str, collections.Counter[str]] = {
            p: collections.Counter() for p in HELPERS
        }
        self.helper_samples: dict[str, int] = dict.fromkeys(HELPERS, 0)
        self.collections: list[tuple[float, float, int]] = []  # (start, end, generation)
        self._gc_start = 0.0
        self.gaps: list[tuple[float, float]] = []  # (end, seconds) of the sampler's blind spots
        self.gap_lines: collections.Counter[str] = collections.Counter()  # seconds by line
        self.census: Census | None = None  # what a full collection walks, at stop

    @property
    def started(self) -> bool:
        return self._thread.ident is not None

    def start(self) -> None:
        self._cpu, self._wall = thread_cpu(), time.perf_counter()
        gc.callbacks.append(self._on_gc)
        if self.garbage:
            gc.collect()
            gc.garbage.clear()
            gc.set_debug(gc.DEBUG_SAVEALL)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        if self._on_gc in gc.callbacks:
            gc.callbacks.remove(self._on_gc)
        self._wall = time.perf_counter() - self._wall
        self._cpu_used = {t: sec - self._cpu.get(t, 0.0) for t, sec in thread_cpu().items()}
        self._names = {t.native_id: t.name for t in threading.enumerate()}  # alive now
        if self.garbage:
            gc.set_debug(0)
            self._count_garbage()
        self.census = census()

    def _count_garbage(self) -> None:
        """What the window's collections found, by type (functions and frames by name)."""
        import torch

        for obj in gc.garbage:
            kind = type(obj)
            name = f"{kind.__module__}.{kind.__qualname__}"
            if kind.__name__ == "function":
                name += f" {obj.__qualname__}"
            elif kind.__name__ == "frame":
                name += f" {obj.f_code.co_name}"
            self.garbage_types[name] += 1
            if isinstance(obj, torch.Tensor):
                self.garbage_tensor_bytes += obj.numel() * obj.element_size()
        gc.garbage.clear()

    def _target(self) -> int | None:
        for t in threading.enumerate():
            if t.name == self.thread_name:
                return t.ident
        return None

    def _on_gc(self, phase: str, info: dict) -> None:
        """gc.callbacks: runs in the collecting thread, around the collection."""
        if phase == "start":
            self._gc_start = time.perf_counter()
        else:
            self.collections.append((self._gc_start, time.perf_counter(), info["generation"]))

    def _run(self) -> None:
        ident = None
        last = time.perf_counter()
        while not self._stop.wait(self.interval):
            ident = ident or self._target()
            frames = sys._current_frames()
            now = time.perf_counter()
            blind = now - last - self.interval
            last = now
            if blind > GAP:
                self._charge_gap(now, blind, frames)
            frame = frames.get(ident) if ident else None
            if frame is not None:
                self._record(frame)
            for t in threading.enumerate():
                pool = next((p for p in HELPERS if t.name.startswith(p)), None)
                if pool is not None and (f := frames.get(t.ident or -1)) is not None:
                    self._record_helper(pool, f)

    def _charge_gap(self, now: float, blind: float, frames: dict[int, FrameType]) -> None:
        """A wait for the GIL (or the CPU) past GAP: its seconds go to the line of each thread
        that is not parked (`_parked`: a queue, an event, a pipe, a device wait)."""
        self.gaps.append((now, blind))
        names = {t.ident: t.name for t in threading.enumerate()}
        for ident, frame in frames.items():
            if ident == threading.get_ident() or _parked(frame):
                continue
            name = names.get(ident, "?").rstrip("0123456789").rstrip("_")
            self.gap_lines[f"{name}: {_where(frame)}"] += blind

    def _record_helper(self, pool: str, frame: FrameType) -> None:
        """One sample of a pool thread: its deepest kvtier frame and its innermost line; a
        thread waiting for work (in the executor's queue) is counted as idle."""
        self.helper_samples[pool] += 1
        chain: list[FrameType] = []
        f: FrameType | None = frame
        while f is not None:
            chain.append(f)
            f = f.f_back
        own = next((fr for fr in chain if _module(fr).startswith("kvtier.")), None)
        if own is None:
            self.helpers[pool]["idle"] += 1
            return
        self.helpers[pool][f"{_where(own)} > {_where(frame)}"] += 1

    def _record(self, frame: FrameType) -> None:
        self.samples += 1
        inner = frame
        chain = []
        f: FrameType | None = frame
        while f is not None:
            chain.append(f)
            f = f.f_back
        method = "idle"
        for i, fr in enumerate(chain):
            if fr.f_code.co_name in OUTER and i > 0:
                method = chain[i - 1].f_code.co_name
                break
        self.methods[method] += 1
        line = f"{method} > {_where(inner)}"
        self.lines[line] += 1
        self.timeline.append((time.perf_counter(), line))

    def tail_report(self, steps: list[tuple[float, float]], top: int = 12) -> str:
        """The scheduler thread's samples in the intervals of the slowest `steps` against the
        typical ones: `steps` are (end time, seconds) in order, the window's only. Each group
        lists its top lines in milliseconds per step (samples x interval / steps)."""
        if len(steps) < 20 or not self.timeline:
            return ""
        ordered = sorted(sec for _, sec in steps)
        p50, p90 = ordered[len(ordered) // 2], ordered[int(len(ordered) * 0.9)]
        groups: dict[str, collections.Counter[str]] = {
            "tail": collections.Counter(),
            "body": collections.Counter(),
        }
        counts = {"tail": 0, "body": 0}
        ends = [t for t, _ in steps]
        kinds = ["tail" if sec > p90 else "body" if sec <= p50 else "" for _, sec in steps]
        for k in kinds:
            if k:
                counts[k] += 1
        i = 0
        for when, line in self.timeline:  # samples and steps are both in time order
            while i < len(ends) and ends[i] < when:
                i += 1
            if i == 0 or i >= len(ends):  # before the first step's interval, or after the last
                continue
            if kinds[i]:
                groups[kinds[i]][line] += 1
        ms = self.interval * 1000
        extra = {"tail": [0.0, 0.0], "body": [0.0, 0.0]}  # garbage collection, blind spots
        for which, spans in ((0, [(e, e - s) for s, e, _ in self.collections]), (1, self.gaps)):
            for end, sec in spans:
                k = bisect.bisect_left(ends, end)
                if 0 < k < len(ends) and kinds[k]:
                    extra[kinds[k]][which] += sec
        out = [
            "  the scheduler thread in the slowest steps' intervals (above P90, "
            f"{counts['tail']} steps) and the typical ones (at or below P50, {counts['body']} "
            "steps), ms per step:"
        ]
        for name in ("tail", "body"):
            n = max(counts[name], 1)
            total = sum(groups[name].values()) * ms / n
            collect, blind = (1000 * sec / n for sec in extra[name])
            out.append(
                f"    {name}: {total:.1f} ms sampled per step; garbage collection {collect:.2f} "
                f"ms per step; the sampler blind (waits past {GAP * 1e3:.0f} ms) {blind:.2f} ms "
                "per step"
            )
            out += [f"      {c * ms / n:6.2f}  {line}" for line, c in groups[name].most_common(top)]
        return "\n".join(out)

    def report(self, top: int = 25) -> str:
        n = max(self.samples, 1)
        out = [f"{self.thread_name}: {self.samples} samples, one per {self.interval * 1e3:.0f} ms"]
        out.append("  by scheduler method:")
        out += [f"    {c / n:6.1%}  {m}" for m, c in self.methods.most_common(12)]
        out.append("  by innermost line:")
        out += [f"    {c / n:6.1%}  {m}" for m, c in self.lines.most_common(top)]
        for pool, lines in self.helpers.items():
            k = max(self.helper_samples[pool], 1)
            if not self.helper_samples[pool]:
                continue
            out.append(
                f"  {pool} threads, {self.helper_samples[pool]} samples (all threads), by deepest "
                "kvtier frame > innermost line:"
            )
            out += [f"    {c / k:6.1%}  {m}" for m, c in lines.most_common(top // 2)]
        if self.collections:
            by_gen: dict[int, list[float]] = collections.defaultdict(list)
            for start, end, gen in self.collections:
                by_gen[gen].append(end - start)
            out.append("  garbage collections meanwhile (every thread):")
            out += [
                f"    generation {gen}: {len(d)}, {sum(d) * 1e3:.1f} ms in all, longest "
                f"{max(d) * 1e3:.1f} ms"
                for gen, d in sorted(by_gen.items())
            ]
        if self.census is not None:
            out.append(self.census.report(top // 2))
        if self.garbage:
            total = sum(self.garbage_types.values())
            out.append(
                f"  cyclic garbage the window's collections found: {total} objects, tensors of "
                f"{self.garbage_tensor_bytes / 2**20:.1f} MiB among them; by type:"
            )
            out += [f"    {c:7d}  {name}" for name, c in self.garbage_types.most_common(top)]
        if self.gaps:
            blind = sum(sec for _, sec in self.gaps)
            out.append(
                f"  the sampler blind: {len(self.gaps)} waits past {GAP * 1e3:.0f} ms, "
                f"{blind * 1e3:.0f} ms in all, longest {max(s for _, s in self.gaps) * 1e3:.1f} "
                "ms; the lines of the busy threads when they ended, ms:"
            )
            out += [
                f"    {sec * 1e3:7.1f}  {line}" for line, sec in self.gap_lines.most_common(top)
            ]
        if self._cpu_used and self._wall > 0:
            names = self._names
            used = sorted(((sec, t) for t, sec in self._cpu_used.items()), reverse=True)
            total = sum(sec for sec, _ in used) / self._wall
            out.append(f"  CPU by thread meanwhile, in cores (all threads: {total:.2f}):")
            out += [
                f"    {sec / self._wall:5.2f}  {names.get(t, f'native {t}')}"
                for sec, t in used[:12]
                if sec / self._wall >= 0.01
            ]
        return "\n".join(out)


@dataclasses.dataclass
class Census:
    """What a full collection walks: the collector's tracked objects outside `gc.freeze()`, by
    type, with the references they hold (a container's traversal visits each of them, a list of
    3,000 token ids 3,000 times) and the time of one full collection over them."""

    objects: int
    references: int
    full_ms: float
    by_type: list[tuple[str, int, int]]  # (type, objects, references), most references first

    def report(self, top: int) -> str:
        out = [
            f"  the collector's objects at the window's end (outside gc.freeze): {self.objects:,} "
            f"holding {self.references:,} references; a full collection over them "
            f"{self.full_ms:.1f} ms; by type (objects, references):"
        ]
        out += [f"    {n:9,d} {r:11,d}  {name}" for name, n, r in self.by_type[:top]]
        return "\n".join(out)


def census() -> Census:
    """After a full collection (garbage freed, tuples of untracked objects untracked), count
    the collector's tracked objects by type and the references each holds (`gc.get_referents`,
    what its traversal visits), then time one more full collection: what every full
    collection of this state costs."""
    gc.collect()
    objs: collections.Counter[str] = collections.Counter()
    refs: collections.Counter[str] = collections.Counter()
    for obj in gc.get_objects():
        kind = type(obj)
        name = f"{kind.__module__}.{kind.__qualname__}"
        objs[name] += 1
        refs[name] += len(gc.get_referents(obj))
    t0 = time.perf_counter()
    gc.collect()
    full_ms = (time.perf_counter() - t0) * 1e3
    rows = sorted(((n, objs[n], refs[n]) for n in objs), key=lambda r: (-r[2], -r[1]))
    return Census(sum(objs.values()), sum(refs.values()), full_ms, rows)


PARKED = ("threading.py", "queue.py", "selectors.py", "thread.py", "connection.py")
DEVICE_WAITS = ("synchronize", "wait", "wait_stream", "wait_event")  # torch.cuda's, GIL released


def _parked(frame: FrameType) -> bool:
    """A thread waiting in the standard library (its innermost frame there), or on a device
    event or stream: not the GIL's holder. (A thread blocked on a lock of kvtier's own still
    counts, on its `with` line.)"""
    name = frame.f_code.co_filename.rsplit("/", 1)[-1]
    return name in PARKED or (name == "streams.py" and frame.f_code.co_name in DEVICE_WAITS)


def _module(frame: FrameType) -> str:
    return str(frame.f_globals.get("__name__", ""))


def _where(frame: FrameType) -> str:
    code = frame.f_code
    return f"{code.co_filename.rsplit('/', 1)[-1]}:{frame.f_lineno} {code.co_name}"
