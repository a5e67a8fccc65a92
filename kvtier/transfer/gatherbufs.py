"""Device buffers that chunks gathered from a batch's pages wait in for their copy down to L2.

A finished turn's commit stores its new K/V chunk by chunk (`TieredCache.commit_pages`). Each
chunk is gathered from the page pool into one of these buffers, copied down to its L2 slot, and
the buffer is reused once that copy is done. Every buffer is one chunk of the model's K/V, made
the first time it is needed and kept: never more than `Inflight.max_bytes` of them, since each
busy buffer holds a ticket of that ledger. So a burst of finished turns waits for buffers
(backpressure, counted by the ledger) instead of putting a new device tensor per turn beside the
pool: the commit path's device memory is the plan's in-flight part, by construction.
"""

from __future__ import annotations

import threading

import torch

from kvtier.transfer.inflight import Inflight, Ticket


class GatherBuffers:
    """Chunk-sized device buffers bound to tickets of `inflight` (at most one per chunk of its
    bound), handed out by `take`, each busy until its ticket's room is given back
    (`Ticket.done`)."""

    def __init__(
        self, inflight: Inflight, device: torch.device, dtype: torch.dtype, chunk_numel: int
    ) -> None:
        self.inflight = inflight
        self.device = device
        self.dtype = dtype
        self.chunk_numel = int(chunk_numel)
        self.chunk_bytes = self.chunk_numel * torch.empty((), dtype=dtype).element_size()
        self.limit = max(1, inflight.max_bytes // max(1, self.chunk_bytes))
        self._lock = threading.Lock()
        self._bufs: list[torch.Tensor] = []
        self._held: list[Ticket] = []  # the ticket each buffer of `_bufs` was last taken with

    @property
    def made(self) -> int:
        """Buffers allocated so far (at most `limit`)."""
        return len(self._bufs)

    @property
    def nbytes(self) -> int:
        """Device bytes the buffers made so far hold."""
        return self.made * self.chunk_bytes

    def take(self, ticket: Ticket, shape: tuple[int, ...]) -> torch.Tensor:
        """A buffer for one chunk of `shape` (at most a chunk's elements), as a contiguous view;
        it is busy until `ticket` (room of a chunk in the ledger) is given back."""
        numel = 1
        for n in shape:
            numel *= int(n)
        if numel > self.chunk_numel:
            raise ValueError(f"a gather of {tuple(shape)} is larger than a chunk")
        with self._lock:
            held = self._held
            for i, old in enumerate(held):
                if old.done:  # its copy is done: the ledger gave its room back
                    held[i] = ticket
                    buf = self._bufs[i]
                    break
            else:
                if len(self._bufs) >= self.limit:
                    # every buffer holds a ticket of a bound this one fits under: not reachable
                    raise RuntimeError("every gather buffer is busy although the ledger gave room")
                buf = torch.empty(self.chunk_numel, dtype=self.dtype, device=self.device)
                self._bufs.append(buf)
                held.append(ticket)
        return buf[:numel].view(shape)
