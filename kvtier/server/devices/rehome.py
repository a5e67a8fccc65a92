"""Moving the primary role to another device, and back (kvtier.server.devices.failover).

The primary device holds, besides the embeddings and the LM head (`PlacedModel` moves those),
the sampler's vocabulary mask and the session L1 of the tiered cache with the device side of
its transfer engine. When the primary moves, on the batch scheduler's thread between two
steps and with the running sequences drained:

1. `quiesce`: the commits in flight finish (they write a finished turn's K/V into L1);
2. `rehome`: the mask is rebuilt on the new primary from its host copy, the cache's L1 moves
   there (`TieredCache.move_l1`: dropped unread when the old device is lost, idle sessions
   hibernated from it first when it works), and each queued sequence whose session's Cache
   lived in the old L1 restores the session's stored prefix into the new L1
   (`TieredCache.reload_session`); `cached` is then what that covers, and the tokens after it
   (the rest of its prompt, its reply so far) are recomputed at admission.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from kvtier.cache.restore import StagedPrefix

log = logging.getLogger("kvtier.server")

# The wait for restores handing their sequence over (see _settle), at most.
SETTLE_S = 5.0
# Share of a GPU's free memory the session L1 may take on a new primary (the pool takes next).
L1_SHARE = 0.4


def quiesce(sched: Any) -> None:
    """Before the primary moves: every commit in flight finishes (it writes the turn's K/V
    into the session's L1 and stores its full chunks). Only this thread submits them."""
    if sched is None:
        return
    sched.commits.quiesce()


def rehome(failover: Any, sched: Any, lost: bool) -> None:
    """The primary moved (`PlacedModel.replace`/`restore`): the sampler's mask, the
    cache's L1 (and its transfer engine's device side) follow it, and every queued
    sequence restores its session into the new L1 (see the module docstring)."""
    device = failover.placed.primary_device
    served = sched.served if sched is not None else failover.served
    if served is not None and failover.allowed is not None:
        served.allowed = failover.allowed.to(device, copy=True)
    cache = getattr(getattr(sched, "backend", None), "cache", None)
    if cache is None or not hasattr(cache, "move_l1"):
        if sched is not None:
            _reload(sched, None)
        return
    # L1's bytes as configured (its staging buffers included): the home primary's again on
    # the way back (kvtier's allocator pool there still holds its segment); on a survivor at
    # most L1_SHARE of the free memory
    budget = failover.home_l1 if not lost and failover.home_l1 else None
    if lost and device.type == "cuda":
        engine = cache.engine
        now = cache.l1.budget_bytes + (engine.staging_bytes if engine.cuda else 0)
        free, _ = torch.cuda.mem_get_info(device)
        budget = min(now, int(free * L1_SHARE))
    before = cache.move_l1(device, budget, lost=lost)
    failover.home_l1 = failover.home_l1 or before
    _reload(sched, cache)


def _reload(sched: Any, cache: Any) -> None:
    """Each queued sequence whose Cache lived on the old primary restores its session's
    stored prefix on the new one (`cached` is then what that covers; the tokens after it
    are recomputed at admission). One that cannot is failed (its session survives)."""
    from kvtier.server.backend import Restored

    # the sequences whose restore finished; a restore that took its L1 hold but has not
    # handed its sequence over yet is waited for (briefly), so none with a Cache on the old
    # primary is missed
    for s in sched.settled(SETTLE_S):
        if s.restored is None or isinstance(s.restored.kv, StagedPrefix):
            continue  # a staged prefix is in L2: the new pool's pages take it at admission
        if s.restored.kv is None:  # nothing restored, or parked pages of the old pool
            s.lose_prefix()
            continue
        owner = getattr(s.restored.kv, "owner", None)
        if owner is not None and getattr(owner, "bufs", None) is not None:
            continue  # restored into the new L1 already
        try:
            if owner is None or cache is None:  # no tiered cache: recompute it all
                s.restored = sched.backend.restore(s.job.session_id, s.job.tenant, s.tokens)
            else:
                kv = cache.reload_session(owner, tuple(s.tokens))
                s.restored = Restored(kv, int(kv.get_seq_length()), owner.restore_source, owner)
            s.cached = s.restored.covered
        except BaseException as exc:
            log.error("session %s: no restore after the failover: %s", s.job.session_id, exc)
            sched.fail_queued(s, exc)
