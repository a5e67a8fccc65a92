"""Bytes, seconds and copies per direction, shared by the device and the disk movers.

One lock guards these totals and the disk mover's queue and failure counts, so `snapshot`
reads all of them at one instant. A device copy is counted when it is issued; its seconds
once its CUDA events have completed (`timing`), folded in lazily so that no copy is waited for.
"""

from __future__ import annotations

import threading
from collections import deque
from dataclasses import dataclass

import torch

from kvtier.snapshot import TransferStats

DIRECTIONS = (("l1", "l2"), ("l2", "l1"), ("l2", "l3"), ("l3", "l2"))
_TIMED_BACKLOG = 256  # timing events kept before they are folded into the totals


@dataclass(frozen=True)
class EngineStats:
    """Bytes and seconds per direction, L3 queue depths, shed or failed writes, staging memory."""

    transfers: tuple[TransferStats, ...]
    l3_write_queue: int
    l3_read_queue: int
    shed_writes: int
    l3_write_errors: int
    l3_read_errors: int
    staging_bytes: int = 0


class Accounts:
    """The engine's per-direction totals (see the module docstring)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self._bytes = dict.fromkeys(DIRECTIONS, 0)
        self._seconds = dict.fromkeys(DIRECTIONS, 0.0)
        self._ops = dict.fromkeys(DIRECTIONS, 0)
        self._timed: deque[tuple[tuple[str, str], torch.cuda.Event, torch.cuda.Event]] = deque()

    def account(self, direction: tuple[str, str], nbytes: int, seconds: float, ops: int) -> None:
        with self.lock:
            self._bytes[direction] += nbytes
            self._seconds[direction] += seconds
            self._ops[direction] += ops

    def timing(
        self,
        direction: tuple[str, str],
        begin: torch.cuda.Event,
        end: torch.cuda.Event,
        nbytes: int,
        ops: int,
    ) -> None:
        """Count a device transfer now; its seconds once its events have completed."""
        with self.lock:
            self._timed.append((direction, begin, end))
            self._bytes[direction] += nbytes
            self._ops[direction] += ops
            backlog = len(self._timed) > _TIMED_BACKLOG
        if backlog:
            self.collect_timings()

    def collect_timings(self) -> None:
        with self.lock:
            while self._timed and self._timed[0][2].query():
                direction, begin, end = self._timed.popleft()
                self._seconds[direction] += begin.elapsed_time(end) / 1000.0

    def transfers(self) -> tuple[TransferStats, ...]:
        """The totals per direction; the caller holds `lock`."""
        return tuple(
            TransferStats(
                src,
                dst,
                self._bytes[src, dst],
                self._seconds[src, dst],
                self._ops[src, dst],
            )
            for src, dst in DIRECTIONS
        )
