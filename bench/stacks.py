"""Where a thread's time goes: sample its Python stack every millisecond (`--stacks`).

A poor man's sampling profiler for one named thread (the batch scheduler, "kvtier-batch"),
in the benchmark's own process. Every sample records two things: the scheduler method the
thread is in (the frame below its loop) and the innermost line it is on. A thread that
waits on the device or for the GIL is counted where it waits, so the table reads as wall time.
"""

from __future__ import annotations

import collections
import sys
import threading
from types import FrameType

OUTER = ("_iterate", "_main")  # the scheduler's loop: report the frame just inside it


class StackSampler:
    def __init__(self, thread_name: str = "kvtier-batch", interval: float = 0.001) -> None:
        self.thread_name = thread_name
        self.interval = interval
        self.methods: collections.Counter[str] = collections.Counter()
        self.lines: collections.Counter[str] = collections.Counter()
        self.samples = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="stack-sampler", daemon=True)

    @property
    def started(self) -> bool:
        return self._thread.ident is not None

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

    def _target(self) -> int | None:
        for t in threading.enumerate():
            if t.name == self.thread_name:
                return t.ident
        return None

    def _run(self) -> None:
        ident = None
        while not self._stop.wait(self.interval):
            ident = ident or self._target()
            frame = sys._current_frames().get(ident) if ident else None
            if frame is not None:
                self._record(frame)

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
        code = inner.f_code
        where = f"{code.co_filename.rsplit('/', 2)[-2:][-1]}:{inner.f_lineno} {code.co_name}"
        self.lines[f"{method} > {where}"] += 1

    def report(self, top: int = 25) -> str:
        n = max(self.samples, 1)
        out = [f"{self.thread_name}: {self.samples} samples, one per {self.interval * 1e3:.0f} ms"]
        out.append("  by scheduler method:")
        out += [f"    {c / n:6.1%}  {m}" for m, c in self.methods.most_common(12)]
        out.append("  by innermost line:")
        out += [f"    {c / n:6.1%}  {m}" for m, c in self.lines.most_common(top)]
        return "\n".join(out)
