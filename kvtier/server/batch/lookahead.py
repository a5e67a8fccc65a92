"""Greedy tokens read back without stopping the GPU: what lets the scheduler overlap steps.

A step's sampled tokens are needed twice: on the device, as the next step's input, and on the
host, to stream text and decide who stops. Read back synchronously, the GPU idles while the
scheduler thread reads them, streams them, and builds and launches the next step: about a fifth
of every step in the 64-session fleet on an H200 (docs/benchmarks-history.md). With every sequence due a
token greedy, the scheduler instead picks the tokens on the device, starts their copy to pinned
host memory, and launches the next step right away, feeding those tokens from the device
(`kvtier.paged.Feed`); only then does it wait for the copy and do the host side of the step
before (`StepRunner._complete`, kvtier/server/batch/stepping.py). A sequence that turns out to have
stopped had one row in the step already running: its K/V and output are dropped.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass
class Ticket:
    """The host copy of one step's tokens, in flight."""

    buffer: torch.Tensor
    rows: int
    event: torch.cuda.Event | None
    # float32 host copies of the rows the host samples itself (`TokenReadback.start`'s `keep`),
    # valid once `wait` returns
    kept: torch.Tensor | None = None

    def wait(self) -> list[int]:
        """Block until the copy is done (the GPU keeps running); the tokens, one per row."""
        if self.event is not None:
            self.event.synchronize()
        return self.buffer[: self.rows].tolist()


class TokenReadback:
    """Greedy tokens of a step: picked on the device, copied to one of two pinned host buffers
    (a step's buffer stays untouched while the next step's copy runs)."""

    def __init__(self, device: torch.device, max_rows: int) -> None:
        self.device = device
        cuda = device.type == "cuda"
        self._buffers = [torch.zeros(max_rows, dtype=torch.long, pin_memory=cuda) for _ in range(2)]
        # pinned float32 rows for `keep`, one per buffer parity, grown on demand
        self._kept: list[torch.Tensor | None] = [None, None]
        self._next = 0

    def start(self, logits: torch.Tensor, keep: Sequence[int] = ()) -> tuple[torch.Tensor, Ticket]:
        """Argmax of every row of `logits` (already masked): the tokens on the device, and the
        ticket of their copy to the host. The rows `keep` (those the host samples itself: a
        grammar, penalties, logprobs) are copied to the host as float32 in the same wait.

        Each kept row is copied by its own slice: indexing by a list of rows would first copy
        the index to the device from pageable memory, which waits for the stream (the step just
        launched), and the next step's launch would no longer overlap this one."""
        tokens = logits.argmax(dim=-1)
        parity = self._next
        buffer = self._buffers[parity]
        self._next ^= 1
        n = tokens.shape[0]
        cuda = self.device.type == "cuda"
        buffer[:n].copy_(tokens, non_blocking=cuda)
        kept = None
        if keep:
            kept = self._kept_rows(parity, len(keep), int(logits.shape[-1]), cuda)
            for j, row in enumerate(keep):
                kept[j].copy_(logits[row], non_blocking=cuda)
        event = None
        if cuda:
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(self.device))
        return tokens, Ticket(buffer, n, event, kept)

    def _kept_rows(self, parity: int, rows: int, vocab: int, pinned: bool) -> torch.Tensor:
        have = self._kept[parity]
        if have is None or have.shape[0] < rows or have.shape[1] != vocab:
            size = max(rows, 0 if have is None else have.shape[0])
            have = torch.empty((size, vocab), dtype=torch.float32, pin_memory=pinned)
            self._kept[parity] = have
        return have[:rows]
