"""L1Room: the session L1 pool, the only place that allocates it, and room made by eviction.

A session's L1 is one block of the pool (`kvtier.tiers.l1.L1Pool`), sized for its tokens and
grown during a forward. Where the budget (or the GPU) is short, idle sessions are evicted,
unpinned first, least recently active first, until the block fits: the eviction itself is the
lifecycle's (`evictor`, wired by the cache), which hibernates the victim. A block released
while a copy down still reads it stays counted in flight (`TransferEngine.inflight`) until
that copy is done.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from kvtier.errors import L1BudgetExceeded

if TYPE_CHECKING:  # pragma: no cover
    from kvtier.cache.guard import CacheGuard
    from kvtier.cache.session import Session
    from kvtier.cache.stats import Counters
    from kvtier.tiers.l1 import L1Pool
    from kvtier.transfer import TransferEngine


def _no_evictor(exclude: Session) -> bool:
    return False


class L1Room:
    def __init__(
        self,
        l1: L1Pool,
        device: torch.device,
        engine: TransferEngine,
        counters: Counters,
        guard: CacheGuard,
    ) -> None:
        self.l1 = l1
        self.device = device  # the model's primary device, where L1 lives
        self.engine = engine
        self.counters = counters
        self.guard = guard
        # evict one idle resident session other than `exclude`; False: none is left
        self.evictor: Callable[[Session], bool] = _no_evictor

    def replace(self, l1: L1Pool, device: torch.device) -> None:
        """A new, empty pool (an L1 move to another device): the old one's blocks are gone."""
        self.l1, self.device = l1, device

    def alloc(self, s: Session, tokens: int) -> None:
        """L1 for `tokens` tokens of the session (grown if it has a block)."""
        if s.bufs is not None:
            self.grow(s, tokens)
            return
        need = self.l1.bytes_for(self.l1.round_up(tokens))
        s.bufs = self._with_room(need, lambda: self.l1.allocate(tokens), exclude=s)
        s.lengths = [0] * self.l1.geometry.num_layers

    def grow(self, s: Session, tokens: int) -> None:
        """More L1 room during a forward (evicts idle sessions under the lock if needed)."""
        assert s.bufs is not None
        bufs = s.bufs
        need = self.l1.bytes_for(self.l1.round_up(tokens))
        keep = max(s.lengths) if s.lengths else 0  # layers already written in this forward
        if tokens > bufs.capacity and bufs.copy is not None:
            # The old block leaves L1's budget once the new one holds its tokens: counted in
            # flight from now until its copy down is done (waited for at the bound).
            self.engine.inflight.retire(bufs.copy, bufs.nbytes)
        old_layers = bufs.layers
        self._with_room(need, lambda: self.l1.grow(bufs, tokens, keep), exclude=s)
        if bufs.layers is not old_layers:
            bufs.copy = None  # no copy has read the new block yet

    def release(self, s: Session) -> None:
        """Free the session's L1. A copy down still reading it keeps its bytes counted, in
        flight (`TransferEngine.inflight`), until it is done: at the bound this waits."""
        if s.bufs is not None:
            self.engine.inflight.retire(s.bufs.copy, s.bufs.nbytes)
            self.l1.release(s.bufs)
            s.bufs, s.lengths = None, []

    def forget(self, s: Session) -> None:
        """Drop the session's block of a pool that is gone (a lost device): nothing to return."""
        if s.bufs is not None:
            s.bufs.released = True
            s.bufs.layers = []
            s.bufs, s.lengths = None, []

    def _with_room(self, need: int, alloc: Any, exclude: Session) -> Any:
        """Run `alloc`, evicting idle sessions (unpinned first, LRU) while L1 is short."""
        with self.guard:
            while True:
                try:
                    if self.l1.free_bytes >= need:
                        return alloc()
                except torch.cuda.OutOfMemoryError:
                    self.counters.oom_retries += 1
                    if not self.evictor(exclude):
                        raise L1BudgetExceeded(
                            "the GPU ran out of memory for L1 and no idle session is left to "
                            "evict; lower l1_bytes or the concurrency"
                        ) from None
                    torch.cuda.empty_cache()
                    continue
                except L1BudgetExceeded:
                    pass
                if not self.evictor(exclude):
                    raise L1BudgetExceeded(
                        f"L1 budget of {self.l1.budget_bytes} bytes cannot hold {need} more bytes "
                        "even after evicting every idle session; raise l1_bytes or lower the "
                        "number of concurrent requests"
                    )
