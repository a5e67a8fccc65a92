"""Moving the session L1 to another device after its device was lost (device failover).

L1 lives on one device (the model's primary device: `TieredCache.device`), together with the
device side of the transfer engine (streams, staging buffers). When that device is lost, what
L1 held is worth nothing: `L1Relocator.move_l1` builds a new, empty L1 pool and a new device mover on
the new device, and every session that was resident keeps only the prefix some other tier
holds:

- its leading full chunks whose copy is in L2 or L3 (write-through stores every full chunk at
  commit); an L2 copy whose device-to-host copy had not completed on the lost device is
  dropped (its bytes may be partial), and so is the prefix from that chunk on;
- what only L1 held (the partial tail, chunks the write policy had not stored yet) is gone and
  is recomputed at the session's next turn: no KV is ever read from the lost device.

An idle session becomes hibernated over that prefix (its record is saved, so a restart finds
the same). A session with a request running (ACTIVE) keeps its state without L1; its holder
calls `TieredCache.reload_session` to restore the stored prefix into the new L1 and continue (a commit
without it fails, and the abort leaves the session hibernated over the stored prefix).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from kvtier.cache.tierset import claim_l1
from kvtier.errors import ConfigError
from kvtier.tiers.l1 import L1Pool
from kvtier.types import SessionState

if TYPE_CHECKING:  # pragma: no cover
    from kvtier.cache.directory import ChunkDirectory
    from kvtier.cache.guard import CacheGuard
    from kvtier.cache.identity import CacheIdentity
    from kvtier.cache.l1room import L1Room
    from kvtier.cache.lifecycle import SessionLifecycle
    from kvtier.cache.records import SessionRecords
    from kvtier.cache.session import Session
    from kvtier.cache.sessiontable import SessionTable
    from kvtier.transfer import TransferEngine

log = logging.getLogger("kvtier.cache")


@dataclass(eq=False, kw_only=True)
class L1Relocator:
    guard: CacheGuard
    identity: CacheIdentity
    directory: ChunkDirectory
    engine: TransferEngine
    table: SessionTable
    records: SessionRecords
    room: L1Room
    lifecycle: SessionLifecycle

    def move_l1(self, device: torch.device, budget: int | None = None, lost: bool = True) -> int:
        """Give the cache a new, empty L1 and device mover on `device`, of `budget` bytes (its
        l1_bytes: staging included; None: as now). With `lost`, the old device is lost and what
        only its L1 held is dropped (see the module docstring); without, the old device works
        and every idle resident session is first hibernated from it (its partial tail too), so
        only the requests running now lose their uncommitted K/V (recomputed). Returns the old
        L1's budget in the same terms, for a later move back."""
        device = torch.device(device)
        with self.guard:
            self.guard.check_open()
            self.guard.wait_loads()  # restores copying into the old L1: let them publish first
            if not lost:
                for s in list(self.table.values()):
                    if s.resident and s.state is not SessionState.ACTIVE:
                        self.lifecycle.hibernate(s, wait=False)
            staging, suspect = self.engine.move_device(device, lost=lost)
            before = self.room.l1.budget_bytes + staging  # l1_bytes as configured (claim_l1)
            budget = before if budget is None else int(budget)
            if self.engine.cuda and self.engine.staging_bytes >= budget:
                raise ConfigError(
                    f"device {device} has no room for L1 beside the transfer engine's staging "
                    f"buffers ({self.engine.staging_bytes} bytes for {budget}); restart the server"
                )
            ident = self.identity
            l1 = L1Pool(ident.geometry, budget, self.engine.device, ident.chunk_tokens)
            self.room.replace(l1, self.engine.device)
            claim_l1(l1, self.engine)
            self._drop_partial_slots(suspect)
            dropped = 0
            for s in list(self.table.values()):
                if s.bufs is None:
                    continue
                dropped += 1
                self.room.forget(s)  # the old pool is gone: no accounting to return
                self._keep_stored_prefix(s)
                if s.state is not SessionState.ACTIVE:
                    s.hibernated()
                    self.records.save(s)
                    self.lifecycle.to_l4(s)
            log.warning(
                "L1 moved to %s (%d bytes); %d resident session(s) resume from L2/L3",
                self.engine.device,
                l1.budget_bytes,
                dropped,
            )
            return before

    def _drop_partial_slots(self, slots: set[int]) -> None:
        if not slots:
            return
        d = self.directory
        for e in list(d.entries.values()):
            if e.l2_slot not in slots:
                continue
            fut = e.l3_write
            if fut is not None:  # it waited on the failed copy: it fails too, nothing written
                fut.exception()
                d.settle_write(e, fut)
            log.warning("L2 copy of chunk %s was still coming from the lost device; dropped", e.key)
            d.free_slot(e)
            if e.key in d.l3_tokens:
                continue
            d.entries.pop(e.key, None)

    def _keep_stored_prefix(self, s: Session) -> None:
        """Cut the session to its leading full chunks that L2 or L3 holds."""
        d = self.directory
        n = 0
        for key in s.chunk_keys:
            e = d.get(key)
            if not (d.in_l3(key) or (e is not None and d.stored(e))):
                break
            n += 1
        s.cut(n * self.identity.chunk_tokens)
