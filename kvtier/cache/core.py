"""TieredCache: the orchestrator of the tiers (L1 GPU, L2 pinned host, L3 SSD).

Data model
- A session's KV lives in L1 while it is resident (`SessionBuffers`, exact attention reads it).
- Every *full* chunk of a session has a content key (`keys.chain`). The `ChunkDirectory` maps
  a key to where copies exist: an L2 slot and/or an L3 file. Equal prefixes share one entry.
- A session's tail (tokens after its last full chunk) is written as a partial chunk only when
  the session leaves L1 (hibernate or eviction), so the session resumes whole.

The class is a facade: it wires the parts below and each public method is one call into a
part. The parts own their state and call each other only downward (docs/architecture.md):
`Restorer` (restore), `PoolSessions` (sessions in a caller's page pool), `L1Relocator`,
`TenantShredder`, `SessionFinder` (opening and finding sessions) > `SessionLifecycle`
(commit, hibernate, close) > `ChunkWriter` > `ChunkCatalog` (keys, where a chunk is: the cold
tiers, `ColdTiers`) > `SharedTier` (L4) > `SessionTable`, `SessionRecords`, `L1Room` (L1 and
its eviction), `L2Tier`, `L3Tier` > `ChunkDirectory`, `CacheIdentity`, `CacheGuard`.

Threading: one re-entrant lock (`CacheGuard`) guards the metadata (sessions, directory,
counters). It is held only for bookkeeping and for starting transfers, never across a wait for
the disk: restore and hibernate plan under the lock, wait for reads, throttle sleeps, copies
and fsyncs outside it, and publish under it again; `stats()` copies numbers under the
lock and asks the store and the engine outside it. The model's forward runs outside it; a
session is never evicted while a request is running on it (state ACTIVE).

Device memory is bounded (`device_bytes`): L1's budget, the staging buffers, and the copies in
flight (`TransferEngine.inflight`: L1 blocks released while their chunks still go down, chunks
gathered from pages) under `CacheConfig.inflight_bytes_max`. At a bound the cache waits rather
than holding more (backpressure, counted): a session leaving L1 whose chunks find every L2 slot
busy with an L3 write waits for one to finish (`ChunkDirectory.wait_for_room`), and a release
past the in-flight bound waits for the oldest copies. These waits, like a write-back, run under
the lock; only where nothing is left to wait for is the session's stored prefix cut (counted as
a drop, recomputed at its next turn).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Sequence
from typing import Any

import torch

from kvtier.cache.catalog import ChunkCatalog, ColdTiers
from kvtier.cache.coldtier import ColdTier
from kvtier.cache.config import CacheConfig
from kvtier.cache.costmodel import CostModel
from kvtier.cache.directory import ChunkDirectory
from kvtier.cache.finder import SessionFinder
from kvtier.cache.guard import CacheGuard
from kvtier.cache.identity import CacheIdentity
from kvtier.cache.keys import SHARED_TENANT
from kvtier.cache.l1room import L1Room
from kvtier.cache.l4 import SharedTier
from kvtier.cache.lifecycle import SessionLifecycle
from kvtier.cache.pages import PoolSessions
from kvtier.cache.records import SessionRecords
from kvtier.cache.relocate import L1Relocator
from kvtier.cache.restore import Restorer
from kvtier.cache.restoreplan import StagedPrefix
from kvtier.cache.session import Ids, Session, as_ids
from kvtier.cache.sessiontable import SessionTable
from kvtier.cache.shred import TenantShredder
from kvtier.cache.stats import Counters, SnapshotInputs, build_snapshot
from kvtier.cache.tierset import L2Tier, L3Tier, open_tiers
from kvtier.cache.upkeep import Upkeep
from kvtier.cache.writes import ChunkSource, ChunkWriter
from kvtier.codecs import Codec
from kvtier.errors import ConfigError
from kvtier.geometry import KVGeometry
from kvtier.integrations.hf import KvtierCache
from kvtier.integrations.paged_cache import PagedCache
from kvtier.paged.pool import PagePool
from kvtier.policy import make_policy
from kvtier.snapshot import CacheSnapshot
from kvtier.tiers.l1 import L1Pool
from kvtier.tiers.l3 import ShredReport
from kvtier.transfer.staging import Handle
from kvtier.types import Tier


class TieredCache:
    """KV cache of many sessions across GPU memory (L1), pinned host RAM (L2) and SSD (L3)."""

    def __init__(self, config: CacheConfig, model: Any) -> None:
        config.__post_init__()  # settings changed after construction are checked again
        self.config = config
        self.model = model
        self.identity = ident = CacheIdentity.of(config, model)
        self.guard = guard = CacheGuard()
        self.counters = counters = Counters()
        device = torch.device(getattr(model, "device", "cpu"))
        # Every resource is released again if a later step fails (reopening the root works).
        with contextlib.ExitStack() as undo:
            l1, self.l3, self.l2, self.engine = open_tiers(
                config, ident.geometry, ident.codec, device, counters, undo
            )
            self.cost = CostModel(
                {Tier.L4.value: 1e9, **config.initial_bandwidth},
                config.initial_prefill_s_per_token,
                margin=config.load_margin,
            )
            # Keys (-> token count) of this model's chunks in L3, loaded once: the hot path
            # never queries the SQLite index, whose writers hold its lock across a commit.
            l3_tokens: dict[bytes, int] = {}
            published = False  # some prefix is published to every tenant
            for row in self.l3.index.iter_chunks():
                if row.header.fingerprint == ident.fingerprint:
                    l3_tokens[row.header.key] = row.header.tokens
                    published |= row.header.tenant == SHARED_TENANT
            self.directory = ChunkDirectory(
                self.l2,
                self.engine,
                make_policy(config.l2_policy),
                l3_tokens,
                ident.header,
                counters,
            )
            # the store reports what its size cap and gc delete; see ChunkDirectory
            self.l3.add_evict_listener(self.directory.on_l3_evicted)
            self.records = SessionRecords(ident.fingerprint, self.l3, counters)
            undo.callback(self.records.close)
            self.table = SessionTable(
                config.session_idle_s,
                config.max_sessions,
                hibernate=functools.partial(self.hibernate_session, wait=False),
                record=self.records.record,
                save=self.records.save_record,
                barrier=self.records.barrier,
            )
            self.room = L1Room(l1, device, self.engine, counters, guard)
            self.l4: SharedTier | None = None
            if config.l4_url is not None:  # the shared tier; Redis may be down: it degrades
                self.l4 = SharedTier(
                    identity=ident,
                    guard=guard,
                    directory=self.directory,
                    table=self.table,
                    records=self.records,
                    cost=self.cost,
                    counters=counters,
                    l2=self.l2,
                    l3=self.l3,
                    engine=self.engine,
                )
                undo.callback(self.l4.close)
            # the cold tiers, nearest first: the order a restore asks them in
            self.tiers = ColdTiers(
                [
                    L2Tier(self.directory, self.cost),
                    L3Tier(self.directory, self.engine, ident, self.cost),
                    *([self.l4] if self.l4 is not None else []),
                ],
                on_register=self._tier_registered,
            )
            self.catalog = ChunkCatalog(
                ident,
                self.directory,
                self.tiers,
                counters,
                published=published,
                shared_keys=self.l4.known if self.l4 is not None else None,
            )
            writer = ChunkWriter(ident, self.directory, self.engine, counters, self.catalog)
            self.lifecycle = SessionLifecycle(
                guard=guard,
                directory=self.directory,
                l4=self.l4,
                table=self.table,
                identity=ident,
                counters=counters,
                cost=self.cost,
                engine=self.engine,
                l2=self.l2,
                l3=self.l3,
                records=self.records,
                room=self.room,
                writer=writer,
                catalog=self.catalog,
            )
            self.room.evictor = self.lifecycle.evict_one
            self.restorer = Restorer(
                guard=guard,
                directory=self.directory,
                table=self.table,
                identity=ident,
                counters=counters,
                cost=self.cost,
                engine=self.engine,
                catalog=self.catalog,
                room=self.room,
                lifecycle=self.lifecycle,
            )
            self.pools = PoolSessions(
                guard=guard,
                identity=ident,
                counters=counters,
                table=self.table,
                records=self.records,
                catalog=self.catalog,
                restorer=self.restorer,
                lifecycle=self.lifecycle,
            )
            self.relocator = L1Relocator(
                guard=guard,
                identity=ident,
                directory=self.directory,
                engine=self.engine,
                table=self.table,
                records=self.records,
                room=self.room,
                lifecycle=self.lifecycle,
            )
            self.shredder = TenantShredder(
                guard=guard,
                directory=self.directory,
                l4=self.l4,
                table=self.table,
                engine=self.engine,
                l3=self.l3,
                records=self.records,
                room=self.room,
                lifecycle=self.lifecycle,
            )
            self.finder = SessionFinder(
                guard=guard,
                identity=ident,
                table=self.table,
                l3=self.l3,
                l4=self.l4,
                make=lambda sid, tenant: Session(self, sid, tenant),
                counters=counters,
            )
            self.finder.load_hibernated()
            self.directory.retry_shed = config.write_policy != "write_back"
            bound = config.l3_write_bound_s
            self.upkeep = Upkeep(min(1.0, max(0.05, (bound or 4.0) / 4)), self.lifecycle.housekeep)
            undo.pop_all()

    def _tier_registered(self, tier: ColdTier) -> None:
        """A cold tier added after start (`tiers.register`): counted like the built-in ones;
        the cost model plans its loads from `CacheConfig.initial_bandwidth[tier]` on."""
        if self.config.cost_model and tier.tier not in self.cost.bandwidth:
            raise ConfigError(
                f"initial_bandwidth has no estimate for tier {tier.tier!r} (bytes/s), "
                "which the cost model needs to plan loads from it"
            )
        with self.guard:  # stats() copies the counters under it
            self.counters.add_tier(tier.tier)

    # -- what the parts know, read-only ---------------------------------------------------------

    @property
    def chunk_tokens(self) -> int:
        return self.identity.chunk_tokens

    @property
    def geometry(self) -> KVGeometry:
        return self.identity.geometry

    @property
    def fingerprint(self) -> bytes:
        return self.identity.fingerprint

    @property
    def codec(self) -> Codec:
        return self.identity.codec

    @property
    def device(self) -> torch.device:
        return self.room.device

    @property
    def l1(self) -> L1Pool:
        return self.room.l1

    # -- sessions -------------------------------------------------------------------------------

    def session(self, session_id: str, tenant: str = "default") -> Session:
        """Open a session, or find it again (after a restart from L3; hibernated on another
        host, or hibernated here and resumed elsewhere since, from L4)."""
        return self.finder.open(session_id, tenant)

    def sessions(self) -> list[Session]:
        return self.finder.all()

    def find_session(self, session_id: str, tenant: str) -> Session | None:
        """The session if it is in memory; never reads L3 or L4 (None once forgotten)."""
        return self.finder.find(session_id, tenant)

    def find_sessions(self, session_id: str, tenant: str | None = None) -> list[Session]:
        """The sessions of this id (of `tenant`, else of every tenant) in memory, and those
        forgotten from it whose record L3 holds, which come back (an admin's calls)."""
        return self.finder.find_all(session_id, tenant)

    def on_forget(self, fn: Callable[[str, str], object]) -> None:
        """`fn(session_id, tenant)` hears of each session forgotten from memory (idle past
        `session_idle_s`, or past `max_sessions`), under the cache's lock: it must neither
        wait nor call the cache."""
        self.table.listen(fn)

    # -- restore (kvtier.cache.restore) and the host API that `Session` calls -----------------

    def restore_session(self, s: Session, ids: Ids) -> KvtierCache:
        return self.restorer.restore_session(s, ids)

    def restore_into(self, s: Session, ids: Ids, pool: PagePool) -> PagedCache:
        """`Session.restore(ids, pool=pool)` (kvtier.cache.pages)."""
        return self.pools.restore(s, ids, pool)

    def reserve_pages(self, view: PagedCache, tokens: int) -> None:
        """Room for `tokens` tokens in a session's pages (`PoolSessions.reserve_pages`)."""
        self.pools.reserve_pages(view, tokens)

    def restore_staged(self, s: Session, ids: Ids) -> KvtierCache | StagedPrefix | None:
        """Restore for a batch whose page pool is the sessions' L1 (`paged_l1`): the longest
        usable prefix of `ids` (never the last token) stays in its L2 slots, pinned, as
        `s.staged` (`kvtier.cache.restore.StagedPrefix`), and no L1 is taken. The batch copies
        it into its pages with `load_staged` and then calls `release_staged`. None: no prefix
        (compute it all); a `KvtierCache`: the session was resident in L1, as `restore`."""
        return self.restorer.restore_staged(s, ids)

    def load_staged(
        self, s: Session, staged: StagedPrefix, write: Callable[[int, torch.Tensor], None]
    ) -> Handle:
        """Copy a staged prefix (`restore_staged`) from its L2 slots for `write`, which lands
        them (`PagePool.write_chunks` with the sequence's pages bound, e.g. a
        `functools.partial`) (`TransferEngine.restore_chunks`: one copy per chunk over PCIe, on
        a side stream on a GPU); order the reads after the returned handle, then
        `release_staged`."""
        return self.restorer.load_staged(s, staged, write)

    def release_staged(self, s: Session, staged: StagedPrefix | None = None) -> None:
        """Unpin the session's staged prefix (`staged`, when given: only if it is still that
        one): its chunks may leave L2 again. Call once the copies of `load_staged` are done."""
        self.restorer.release_staged(s, staged)

    def resume_pages(self, s: Session, ids: Ids, held: int) -> int:
        """Start a turn whose first `held` tokens' K/V a batch's page pool holds (`paged_l1`:
        the pages are the session's L1): nothing is copied. Returns how many leading tokens
        of `ids` (never the last) the turn may take from those pages: the part of `held` that
        the session's stored tokens also cover, so that the commit that follows continues a
        prefix the cache knows. 0: none; the session is then left as it was, for `restore`."""
        return self.restorer.resume_pages(s, ids, held)

    def prefetch_session(self, s: Session) -> None:
        with self.guard:
            self.catalog.prefetch(s)

    def grow_session(self, s: Session, tokens: int) -> None:
        """More L1 room during a forward (evicts idle sessions under the lock if needed)."""
        self.room.grow(s, tokens)

    def alloc_l1(self, s: Session, tokens: int) -> None:
        self.room.alloc(s, tokens)

    def chunk_counts(self, keys: list[bytes]) -> tuple[int, int]:
        """(chunks in L2, chunks in L3) among `keys` (for `Session.info`)."""
        with self.guard:
            return self.directory.count(keys)

    def key_for(self, parent: bytes, toks: Sequence[int], s: Session) -> bytes:
        """Key of a full chunk: the shared namespace's if that prefix was published."""
        return self.catalog.key_for(parent, toks, s)

    def keyed(self, parent: bytes, toks: Sequence[int], s: Session) -> tuple[bytes, bool]:
        """`key_for`, and whether the key is the shared namespace's (`ChunkCatalog.keyed`)."""
        return self.catalog.keyed(parent, toks, s)

    def truncate(self, s: Session, n: int) -> None:
        """Keep the first `n` of the session's tokens (`Session.truncate`)."""
        s.truncate(n)

    # -- commit, hibernate, close (kvtier.cache.lifecycle) --------------------------------------

    def commit_session(self, s: Session, ids: Ids) -> None:
        if s.pages is not None:  # restored into a caller's page pool
            self.pools.commit(s, ids)
        else:
            self.lifecycle.commit(s, ids)

    def commit_pages(self, s: Session, ids: Ids, start: int, chunks: Sequence[ChunkSource]) -> None:
        """See `SessionLifecycle.commit_pages`."""
        self.lifecycle.commit_pages(s, ids, start, chunks)

    def pages_dropped(self, s: Session) -> None:
        """A batch freed the pages of an idle `in_pages` session (`commit_pages`): it is
        hibernated now, in L2/L3 alone."""
        self.lifecycle.pages_dropped(s)

    def abort_session(self, s: Session) -> None:
        self.lifecycle.abort(s)

    def hibernate_session(self, s: Session, *, wait: bool = True) -> None:
        self.lifecycle.hibernate(s, wait=wait)

    def close_session(self, s: Session) -> None:
        self.lifecycle.close_session(s)

    def publish_shared(self, input_ids: torch.Tensor | Sequence[int], session: Session) -> int:
        """Publish the full chunks of a resident session's prefix to every tenant.

        Returns the number of chunks published. Use it for system prompts and tool schemas
        that are not secret; everything else stays per tenant. Published chunks are written to
        L3 under the shared tenant, so a restarted cache serves them too.
        """
        return self.lifecycle.publish_shared(as_ids(input_ids), session)

    def evict_l2(self) -> int:
        """Drop every L2 copy that is durable in L3 (frees host RAM); returns chunks dropped."""
        return self.lifecycle.evict_l2()

    def shred_tenant(self, tenant: str) -> ShredReport:
        """Forget every session and chunk of `tenant` in every tier, and destroy its data key.

        L1 and L2 copies are dropped now and its sessions closed without a record; in L3 the
        tenant's data key and session records are destroyed in one transaction
        (`L3Store.shred_tenant`), so its chunk files are unreadable at once and the next gc
        removes them (a plain store deletes them now). Its next request recomputes. Raises
        SessionError while one of its sessions has a request running (retry after it).

        With L4, the tenant's data keys, session records and the chunks this host knows of
        leave Redis as well (best effort: `SharedTier.shred`); a sealed value left there names
        a destroyed key and is a miss on every host."""
        return self.shredder.shred(tenant)

    # -- moving L1 to another device (device failover, kvtier.cache.relocate) -------------------

    def move_l1(self, device: torch.device, budget: int | None = None, lost: bool = True) -> int:
        """A new, empty L1 on `device`; returns the old budget (`L1Relocator.move_l1`)."""
        return self.relocator.move_l1(device, budget, lost)

    def reload_session(self, s: Session, ids: Ids) -> KvtierCache:
        """After `move_l1`: restore a running request's session into the new L1."""
        return self.restorer.reload(s, ids)

    # -- device memory and stats ----------------------------------------------------------------

    def device_bytes(self) -> dict[str, int]:
        """The most device memory kvtier holds, by part, in bytes (for a server's GPU memory
        plan): 'l1' the L1 pool's budget (claimed whole at start on a GPU), 'staging' the
        transfer engine's staging buffers, 'inflight_max' the bound of copies in flight
        (`CacheConfig.inflight_bytes_max`: L1 blocks released while their chunks still go
        down, chunks gathered from pages). kvtier never holds more than their sum; on a GPU
        `l1_bytes` is 'l1' + 'staging', and 'inflight_max' comes on top of it."""
        return {
            "l1": self.l1.budget_bytes,
            "staging": self.engine.staging_bytes,
            "inflight_max": self.engine.inflight.max_bytes,
        }

    def inflight_bytes(self) -> int:
        """Device bytes copies in flight hold now, at most `device_bytes()['inflight_max']`
        (besides them kvtier holds `l1.used_bytes` of L1 and the staging buffers)."""
        return self.engine.inflight_bytes()

    def observe_prefill(self, tokens: int, seconds: float) -> None:
        """Teach the cost model a prefill timed outside a session's Cache (a batched forward of
        `tokens` prompt tokens that took `seconds`): restores weigh loading against that."""
        with self.guard:
            self.cost.observe_prefill(tokens, seconds)

    def stats(self) -> CacheSnapshot:
        """A frozen snapshot of every tier, session and counter. Never waits for I/O: the
        numbers are copied under the lock; the store and the engine are asked outside it."""
        with self.guard:
            self.lifecycle.reap()
            C = self.chunk_tokens
            inputs = SnapshotInputs(
                counters=self.counters.copy(),
                l1_budget=self.l1.budget_bytes,
                l1_used=self.l1.used_bytes,
                l1_chunks=sum(-(-len(s.tokens) // C) for s in self.table.values() if s.resident),
                l2_slots=self.l2.n_slots,
                l2_free=self.l2.free_slots,
                l2_slot_bytes=self.l2.slot_bytes,
                sessions=tuple(s.info() for s in self.table.values()),
                l4_chunks=len(self.l4.known) if self.l4 is not None else 0,
            )
        l4 = self.l4.stats() if self.l4 is not None else None
        return build_snapshot(inputs, self.l3.stats(), self.engine.stats(), l4)

    # -- lifetime -------------------------------------------------------------------------------

    def flush(self) -> None:
        """Wait for every queued L3 write."""
        self.lifecycle.flush()

    def close(self) -> None:
        """Hibernate every resident session to L3, then release every resource. Idempotent."""
        self.lifecycle.close_all(self.upkeep.stop)

    def __enter__(self) -> TieredCache:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


__all__ = ["Session", "TieredCache"]
