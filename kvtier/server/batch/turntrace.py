"""A turn's timing: its latencies for /metrics, and where the time to its first token went (one
DEBUG line per turn on `kvtier.turns`).

The batch scheduler keeps a `TurnTrace` on each request. It notes the turn's admission and each
of its tokens on the turn's `TurnClock` (kvtier.server.reqmetrics: the latency histograms), and
logs, when the first token's logits arrive, queued (admission to the restore pool), restore,
waiting (restored to admitted into the batch), copy-in of the cached K/V, each step the turn was
part of, the rest (sampling, waiting for the device), device allocations (cudaMalloc) meanwhile
and the CPU each thread of the process used meanwhile. `bench/restart.py --diagnose` prints
these lines; they found the 13-20 ms the first request of a process used to pay
(kvtier/server/warm_request.py).
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field

import torch

from kvtier.server.reqmetrics import TurnClock

turns_log = logging.getLogger("kvtier.turns")


def tracing() -> bool:
    return turns_log.isEnabledFor(logging.DEBUG)


@dataclass
class TurnTrace:
    """perf_counter instants and sums of one turn up to its first token; its admission and
    tokens go on to its `clock` (the stream's)."""

    clock: TurnClock
    restore: float = 0.0  # the restore pool began this turn's restore
    restored: float = 0.0  # ... and handed it to the scheduler
    room_wait_s: float = 0.0  # of which waiting for L1 room (turns running hold it)
    admit: float = 0.0  # admission into the batch began (pages, copy-in)
    copy_in_s: float = 0.0
    steps: int = 0  # forwards this turn was part of before its first token
    step_s: float = 0.0  # their summed wall time
    step_ms: list[float] = field(default_factory=list)  # each of them, when tracing
    mallocs: int = 0  # device allocations so far at admission, when tracing
    cpu: dict[int, float] | None = None  # CPU seconds of each thread at admission, when tracing

    def admitting(self, device: torch.device) -> None:
        """Its admission into the batch begins (pages, copy-in): its queue time ends."""
        self.admit = time.perf_counter()
        self.clock.admit(self.admit)
        if tracing():
            self.mallocs, self.cpu = device_allocs(device), thread_cpu()

    def copied_in(self) -> None:
        self.copy_in_s = time.perf_counter() - self.admit

    def token(self, now: float) -> None:
        """It produced a token at `now`."""
        self.clock.token(now)

    def step(self, seconds: float) -> None:
        self.steps += 1
        self.step_s += seconds
        if self.cpu is not None:
            self.step_ms.append(round(seconds * 1000, 1))

    def log_first(
        self,
        session_id: str,
        admitted: float,
        now: float,
        source: str,
        cached: int,
        prompt: int,
        device: torch.device,
    ) -> None:
        """The DEBUG line for a turn whose first token is due at `now`."""
        if not tracing():
            return
        ms = 1000.0
        turns_log.debug(
            "turn %s: first token %.1f ms after admission: queued %.1f, restore %.1f (%s, %d of "
            "%d cached; %.1f waiting for L1 room), waiting %.1f, copy-in %.1f, %d steps %.1f %s, "
            "rest %.1f; %d device allocations; CPU ms by thread meanwhile: %s",
            session_id[:64],
            (now - admitted) * ms,
            (self.restore - admitted) * ms,
            (self.restored - self.restore) * ms,
            source,
            cached,
            prompt,
            self.room_wait_s * ms,
            (self.admit - self.restored) * ms,
            self.copy_in_s * ms,
            self.steps,
            self.step_s * ms,
            self.step_ms,
            (now - self.admit - self.step_s) * ms,
            device_allocs(device) - self.mallocs,
            busy_threads(self.cpu),
        )


def device_allocs(device: torch.device) -> int:
    """cudaMalloc calls of this process so far on `device` (0 off CUDA)."""
    if device.type != "cuda":
        return 0
    return int(torch.cuda.memory_stats(device).get("num_device_alloc", 0))


def thread_cpu() -> dict[int, float]:
    """CPU seconds so far of each thread of this process, by native thread id."""
    import psutil

    return {t.id: t.user_time + t.system_time for t in psutil.Process().threads()}


def busy_threads(before: dict[int, float] | None) -> str:
    """The threads that used at least 1 ms of CPU since `before`, by name."""
    if before is None:
        return "-"
    names = {t.native_id: t.name for t in threading.enumerate()}
    used = {
        names.get(tid, str(tid)): (sec - before.get(tid, 0.0)) * 1000
        for tid, sec in thread_cpu().items()
    }
    busy = sorted(((ms, name) for name, ms in used.items() if ms >= 1.0), reverse=True)
    return ", ".join(f"{name} {ms:.0f}" for ms, name in busy) or "none"
