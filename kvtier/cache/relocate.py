"""Moving the session L1 to another device after its device was lost (device failover).

L1 lives on one device (the model's primary device: `TieredCache.device`), together with the
device side of the transfer engine (streams, staging buffers). When that device is lost, what
L1 held is worth nothing: `relocate_l1` builds a new, empty L1 pool and a new device mover on
the new device, and every session that was resident keeps only the prefix some other tier
holds:

- its leading full chunks whose copy is in L2 or L3 (write-through stores every full chunk at
  commit); an L2 copy whose device-to-host copy had not completed on the lost device is
  dropped (its bytes may be partial), and so is the prefix from that chunk on;
- what only L1 held (the partial tail, chunks the write policy had not stored yet) is gone and
  is recomputed at the session's next turn: no KV is ever read from the lost device.

An idle session becomes hibernated over that prefix (its record is saved, so a restart finds
the same). A session with a request running (ACTIVE) keeps its state without L1; its holder
calls `reload_session` to restore the stored prefix into the new L1 and continue (a commit
without it fails, and the abort leaves the session hibernated over the stored prefix).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import torch

from kvtier.cache.tierset import claim_l1
from kvtier.errors import ConfigError, SessionError
from kvtier.tiers.l1 import L1Pool
from kvtier.transfer.device import DeviceMover
from kvtier.types import SessionState

if TYPE_CHECKING:  # pragma: no cover
    from kvtier.cache.core import TieredCache
    from kvtier.cache.session import Ids, Session
    from kvtier.integrations.hf import KvtierCache

log = logging.getLogger("kvtier.cache")


def relocate_l1(
    cache: TieredCache, device: torch.device, budget: int | None = None, lost: bool = True
) -> int:
    """Give the cache a new, empty L1 and device mover on `device`, of `budget` bytes (its
    l1_bytes: staging included; None: as now). With `lost`, the old device is lost and what
    only its L1 held is dropped (see the module docstring); without, the old device works and
    every idle resident session is first hibernated from it (its partial tail too), so only
    the requests running now lose their uncommitted K/V (recomputed). Returns the old L1's
    budget in the same terms, for a later move back."""
    device = torch.device(device)
    with cache._lock:
        cache._check_open()
        while cache._restoring:  # restores copying into the old L1: let them publish first
            cache._idle.wait()
        engine = cache.engine
        old = engine._device
        if not lost:
            for s in list(cache._sessions.values()):
                if s.resident and s.state is not SessionState.ACTIVE:
                    cache.hibernate_session(s, wait=False)
            old.synchronize()  # the copies down have left the old device
        staging = old.staging_bytes if old.cuda else 0
        before = cache.l1.budget_bytes + staging  # l1_bytes as configured (see claim_l1)
        budget = before if budget is None else int(budget)
        suspect = _unfinished_copies(old) if lost else set()
        if lost:  # what copies in flight held was on the lost device
            engine.inflight.clear()
        mover = DeviceMover(
            old.geometry,
            old.chunk_tokens,
            device,
            old.arena,
            old.codec,
            engine._accounts,
            engine._settle_io,
            group_chunks=old.group_chunks,
        )
        old._closed = True  # never wait for a lost device's streams
        old.free()
        engine._device = mover
        engine.device = mover.device
        engine.cuda = mover.cuda
        engine._disk._last_copy = mover.last_copy
        if mover.cuda and mover.staging_bytes >= budget:
            raise ConfigError(
                f"device {device} has no room for L1 beside the transfer engine's staging "
                f"buffers ({mover.staging_bytes} bytes for {budget}); restart the server"
            )
        cache.device = mover.device
        cache.l1 = L1Pool(cache.geometry, budget, mover.device, cache.chunk_tokens)
        claim_l1(cache.l1, cache.engine)
        _drop_partial_slots(cache, suspect)
        dropped = 0
        for s in list(cache._sessions.values()):
            if s.bufs is None:
                continue
            dropped += 1
            s.bufs.released = True  # the old pool is gone: no accounting to return
            s.bufs.layers = []
            s.bufs, s.lengths = None, []
            _keep_stored_prefix(cache, s)
            if s.state is not SessionState.ACTIVE:
                s.state = SessionState.HIBERNATED
                cache._submit_record(cache.l3.save_session, cache._record(s))
                cache._to_l4(s)
        log.warning(
            "L1 moved to %s (%d bytes); %d resident session(s) resume from L2/L3",
            mover.device,
            cache.l1.budget_bytes,
            dropped,
        )
        return before


def reload_session(cache: TieredCache, s: Session, ids: Ids) -> KvtierCache:
    """A session with a request running whose L1 was dropped (`relocate_l1`): restore the
    longest stored prefix of `ids` into the new L1, as `Session.restore` does."""
    with cache._lock:
        if s.state is not SessionState.ACTIVE or s.bufs is not None:
            raise SessionError(
                f"session {s.session_id[:64]!r} still has its L1 (or no request running); "
                "reload is only for a running request whose L1 device was lost"
            )
        s.state = SessionState.HIBERNATED
    return cache.restore_session(s, ids)


def _unfinished_copies(mover: DeviceMover) -> set[int]:
    """L2 slots whose last device-to-host copy did not complete (the device failed under it):
    their bytes may be partial. On a device that still works every copy completes here."""
    out = set()
    for slot, handle in list(mover._slot_copy.items()):
        if handle.direction != ("l1", "l2"):
            continue
        try:
            handle.wait()
        except Exception:  # a lost GPU raises from its events
            out.add(slot)
    mover._slot_copy.clear()
    return out


def _drop_partial_slots(cache: TieredCache, slots: set[int]) -> None:
    if not slots:
        return
    d = cache.directory
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


def _keep_stored_prefix(cache: TieredCache, s: Session) -> None:
    """Cut the session to its leading full chunks that L2 or L3 holds."""
    d = cache.directory
    n = 0
    for key in s.chunk_keys:
        e = d.get(key)
        if not (d.in_l3(key) or (e is not None and d.stored(e))):
            break
        n += 1
    C = cache.chunk_tokens
    s.tokens = s.tokens[: n * C]
    del s.chunk_keys[n:]
    s.flushed = min(s.flushed, n)
    s.tail_key = None
