"""TieredCache and Session: the orchestrator of DESIGN.md sections 3 and 6.

Data model
- A session's KV lives in L1 while it is resident (`SessionBuffers`, exact attention reads it).
- Every *full* chunk of a session has a content key (`keys.chain`). The chunk directory maps a key
  to where copies exist: an L2 slot and/or an L3 file. Equal prefixes share one entry.
- A session's tail (tokens after its last full chunk) is written as a partial chunk only when
  the session leaves L1 (hibernate or eviction), so the session resumes whole.

Threading: one re-entrant lock guards all metadata. The model's forward runs outside it; a
session is never evicted while a request is running on it (state ACTIVE).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from array import array
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch

from kvtier.cache.config import CacheConfig
from kvtier.cache.costmodel import CostModel
from kvtier.cache.keys import SHARED_TENANT, ZERO_KEY, chunk_key, namespace
from kvtier.cache.session import Session, _as_list
from kvtier.cache.stats import Counters, build_snapshot
from kvtier.codecs import make_codec
from kvtier.errors import (
    BudgetError,
    ConfigError,
    FingerprintMismatch,
    KvbinFormatError,
    L1BudgetExceeded,
    SessionError,
    StoreError,
    StoreFullError,
)
from kvtier.geometry import KVGeometry, model_fingerprint, normalize_dtype
from kvtier.integrations.hf import KvtierCache
from kvtier.kvbin import ChunkHeader
from kvtier.policy import make_policy
from kvtier.snapshot import (
    RESTORE_BUCKETS,
    CacheSnapshot,
)
from kvtier.tiers.l1 import L1Pool
from kvtier.tiers.l2 import HostArena
from kvtier.tiers.l3 import L3Store, SessionRecord
from kvtier.transfer import TransferEngine
from kvtier.types import RestoreSource, SessionState
from kvtier.weights import weights_digest

log = logging.getLogger("kvtier.cache")


@dataclass(eq=False)
class _Chunk:
    """Where copies of one chunk exist. L1 copies belong to sessions, not to this entry."""

    key: bytes
    parent: bytes
    tokens: int
    l2_slot: int | None = None
    in_l3: bool = False
    l3_write: Future | None = None  # in-flight L2 -> L3 write
    l3_read: Future | None = None  # in-flight L3 -> L2 prefetch
    seen: int = 0


class TieredCache:
    """KV cache of many sessions across GPU memory (L1), pinned host RAM (L2) and SSD (L3)."""

    def __init__(self, config: CacheConfig, model: Any) -> None:
        self.config = config
        self.chunk_tokens = config.chunk_tokens
        self.model = model
        self.device = torch.device(getattr(model, "device", "cpu"))
        dtype = normalize_dtype(getattr(model, "dtype", torch.float32))
        self.geometry = KVGeometry.from_config(model.config, dtype=dtype)
        model_id = config.model_id or getattr(model.config, "_name_or_path", "") or "unnamed"
        self.fingerprint = model_fingerprint(
            model.config,
            self.geometry,
            model_id=model_id,
            codec=config.codec,
            weights_digest=weights_digest(model),
        )
        self.codec = make_codec(config.codec, self.geometry)
        l1_bytes = config.l1_bytes or _default_l1_bytes(self.device)
        self.l1 = L1Pool(self.geometry, l1_bytes, self.device, self.chunk_tokens)
        slot_bytes = self.codec.payload_bytes(self.chunk_tokens)
        self.l3 = L3Store(
            config.l3_root,
            keep_page_cache=config.keep_page_cache,
            max_bytes=config.l3_max_bytes,
            cold_dir=config.l3_cold_root,
        )
        writer = config.l3_writer
        if writer == "auto":
            writer = "process" if self.device.type == "cuda" else "threads"
        want_process = writer == "process" and hasattr(os, "memfd_create")
        try:
            self.l2, self.engine = self._build_l2(config, slot_bytes, want_process)
        except (BudgetError, OSError) as exc:
            if not want_process:
                self.l3.close()
                raise
            # Shared memory or the child could not be had here: the same cache with writer
            # threads (write-through then competes with decode for this interpreter).
            log.warning("L3 writer process unavailable (%s); writing L3 from threads", exc)
            try:
                self.l2, self.engine = self._build_l2(config, slot_bytes, False)
            except BaseException:
                self.l3.close()
                raise
        try:
            self._claim_l1()
        except BaseException:
            self.engine.close()
            self.l2.close()
            self.l3.close()
            raise
        self._cost = CostModel(
            config.initial_bandwidth,
            config.initial_prefill_s_per_token,
            margin=config.load_margin,
        )
        self._l2_policy = make_policy(config.l2_policy)
        self._lock = threading.RLock()
        self._chunks: dict[bytes, _Chunk] = {}
        self._writing: set[bytes] = set()  # keys with an L2 -> L3 write in flight
        self._sessions: dict[tuple[str, str], Session] = {}
        self._n = Counters()
        # Keys (-> token count) of this model's chunks in L3, loaded once: the hot path never
        # queries the SQLite index, whose writers hold its lock across an fsync'd commit.
        self._l3_tokens: dict[bytes, int] = {
            row.header.key: row.header.tokens
            for row in self.l3.index.iter_chunks()
            if row.header.fingerprint == self.fingerprint
        }
        self._bg = ThreadPoolExecutor(1, thread_name_prefix="kvtier-records")
        self._closed = False
        self._published = False  # set once a prefix is published to every tenant
        self._load_hibernated()

    def _claim_l1(self) -> None:
        """On a GPU, l1_bytes is all of kvtier's device memory: the engine's staging buffers
        come out of it, and the rest is claimed for L1 now (`L1Pool.reserve`)."""
        if self.device.type != "cuda":
            return
        staging = self.engine.staging_bytes
        if staging >= self.l1.budget_bytes:
            raise ConfigError(
                f"l1_bytes ({self.l1.budget_bytes}) must exceed the transfer engine's staging "
                f"buffers ({staging} bytes); raise l1_bytes"
            )
        self.l1.budget_bytes -= staging
        self.l1.reserve()

    # -- sessions -------------------------------------------------------------------------------

    def _build_l2(
        self, config: CacheConfig, slot_bytes: int, writer_process: bool
    ) -> tuple[HostArena, TransferEngine]:
        """The L2 arena and the transfer engine (shared L2 + writer process, or neither)."""
        arena = HostArena(slot_bytes, config.l2_bytes, pin=config.pin_memory, shared=writer_process)
        try:
            engine = TransferEngine(
                self.geometry,
                self.chunk_tokens,
                self.device,
                arena,
                self.l3,
                self.codec,
                l3_write_queue=config.l3_write_queue,
                l3_threads=config.l3_threads,
                writer_process=writer_process,
            )
        except BaseException:
            arena.close()
            raise
        return arena, engine

    def session(self, session_id: str, tenant: str = "default") -> Session:
        """Open a session, or find it again (also after a restart, from L3)."""
        if not isinstance(session_id, str) or not session_id:
            raise SessionError("session_id must be a non-empty string")
        with self._lock:
            self._check_open()
            key = (tenant, session_id)
            s = self._sessions.get(key)
            if s is None:  # hibernated sessions of earlier processes were loaded at start
                s = Session(self, session_id, tenant)
                self._sessions[key] = s
            return s

    def sessions(self) -> list[Session]:
        with self._lock:
            return list(self._sessions.values())

    def _load_hibernated(self) -> None:
        for rec in self.l3.list_sessions():
            if rec.fingerprint != self.fingerprint:
                continue
            s = Session(self, rec.session_id, rec.tenant)
            self._adopt_record(s, rec)
            self._sessions[(rec.tenant, rec.session_id)] = s

    def _adopt_record(self, s: Session, rec: SessionRecord) -> None:
        s.tokens = list(array("i", rec.token_ids))
        n_full = len(s.tokens) // self.chunk_tokens
        keys = list(rec.chunk_keys)
        s.chunk_keys = keys[:n_full]
        s.tail_key = keys[n_full] if len(keys) > n_full else None
        s.flushed = n_full
        s.pinned = rec.pinned
        s.ttl_s = rec.ttl_s
        s.last_active = rec.last_active
        s.state = SessionState.HIBERNATED

    def _save_record(self, s: Session) -> None:
        """Save now; through the record thread so it lands after every save queued earlier."""
        self._bg.submit(self.l3.save_session, self._record(s)).result()

    def _record(self, s: Session) -> SessionRecord:
        keys = tuple(s.chunk_keys) + ((s.tail_key,) if s.tail_key else ())
        return SessionRecord(
            session_id=s.session_id,
            tenant=s.tenant,
            fingerprint=self.fingerprint,
            token_ids=array("i", s.tokens).tobytes(),
            chunk_keys=keys,
            pinned=s.pinned,
            ttl_s=s.ttl_s,
            last_active=s.last_active,
            state=s.state.value,
        )

    # -- restore --------------------------------------------------------------------------------

    def _restore(self, s: Session, ids: list[int]) -> KvtierCache:
        if not ids:
            raise SessionError("restore needs at least one input token")
        t0 = time.perf_counter()
        with self._lock:
            self._check_open()
            if s.state is SessionState.ACTIVE:
                raise SessionError(
                    f"session {s.session_id[:64]!r} already has a request running; "
                    "requests of one session must be served in order"
                )
            if s.state is SessionState.CLOSED:
                raise SessionError("session is closed; open it again with cache.session()")
            self._reap()
            s.state = SessionState.ACTIVE
            s.last_active = time.time()
            try:
                source = self._assemble(s, ids[:-1])  # leave the last token to compute
            except BaseException:
                s.state = SessionState.IDLE if s.resident else SessionState.HIBERNATED
                raise
            s.restore_source = source
            self._n.decisions[source] += 1
            self._record_latency(source, time.perf_counter() - t0)
            return KvtierCache(s)  # type: ignore[arg-type]  # resident: bufs is set

    def _assemble(self, s: Session, want: list[int]) -> str:
        """Fill the session's L1 with the longest worthwhile cached prefix of `want`."""
        C = self.chunk_tokens
        if s.resident:
            common = _common_prefix(s.tokens, want)
            if common > 0:
                self._truncate(s, common)
                self._n.hits["l1"] += 1
                self._n.restored_tokens["l1"] += common
                return RestoreSource.L1.value
            self._truncate(s, 0)
        # Not resident (or nothing in common): look the prefix up chunk by chunk.
        segments: list[tuple[str, _Chunk]] = []
        parent = ZERO_KEY
        tail = self._tail_len(s) if s.tail_key is not None else 0
        for i in range(len(want) // C + 1):
            toks = want[i * C : (i + 1) * C]
            entry = None
            if len(toks) == C:
                key = self._key_for(parent, toks, s)
                entry, src = self._locate(key)
            if (
                entry is None
                and tail
                and len(toks) >= tail
                and chunk_key(parent, toks[:tail], s.ns) == s.tail_key
            ):
                # the session's own hibernated partial tail, at the end of its stored prefix
                entry, src = self._locate(s.tail_key)
            if entry is None:
                self._n.misses["l3"] += 1
                break
            segments.append((src, entry))
            parent = entry.key
            if entry.tokens < C:
                break
        if self.config.cost_model:
            plan = self._cost.plan(
                [(src, self.codec.payload_bytes(e.tokens), e.tokens) for src, e in segments]
            )
            segments = segments[:plan]
        loaded_tokens = sum(e.tokens for _, e in segments)
        self._alloc_l1(s, max(len(want) + 1, loaded_tokens))
        s.tokens, s.chunk_keys, s.flushed, s.tail_key = [], [], 0, None
        segments = self._load_segments(s, segments)
        pos = 0
        deepest = RestoreSource.RECOMPUTE.value
        for src, entry in segments:
            if entry.tokens == C:
                s.chunk_keys.append(entry.key)
            pos += entry.tokens
            self._n.hits[src] += 1
            self._n.restored_tokens[src] += entry.tokens
            if deepest == RestoreSource.RECOMPUTE.value or src == "l3":
                deepest = src
        s.flushed = len(s.chunk_keys)
        s.tokens = want[:pos]
        s.lengths[:] = [pos] * len(s.lengths)
        if pos > len(want):  # cannot happen: segments follow `want`
            raise AssertionError("restored more tokens than asked for")
        self._n.restored_tokens[RestoreSource.RECOMPUTE.value] += len(want) + 1 - pos
        return deepest

    def _tail_len(self, s: Session) -> int:
        return len(s.tokens) % self.chunk_tokens

    def _key_for(self, parent: bytes, toks: list[int], s: Session) -> bytes:
        """Key of a full chunk: the shared namespace's if that prefix was published."""
        shared = chunk_key(parent, toks, self._shared_ns)
        if shared in self._chunks or (self._published and shared in self._l3_tokens):
            return shared
        return chunk_key(parent, toks, s.ns)

    @property
    def _shared_ns(self) -> bytes:
        return namespace(self.fingerprint, SHARED_TENANT)

    def _locate(self, key: bytes) -> tuple[_Chunk | None, str]:
        entry = self._chunks.get(key)
        if entry is not None and entry.l3_read is not None:
            self._finish_prefetch(entry)
        if entry is not None and entry.l2_slot is not None:
            return entry, "l2"
        self._n.misses["l2"] += 1
        if entry is not None and entry.in_l3:
            return entry, "l3"
        tokens = self._l3_tokens.get(key)
        if tokens is None:
            return None, ""
        entry = self._chunks.setdefault(key, _Chunk(key=key, parent=ZERO_KEY, tokens=tokens))
        self._set_in_l3(entry, True)
        return entry, "l3"

    def _load_segments(
        self, s: Session, segments: list[tuple[str, _Chunk]]
    ) -> list[tuple[str, _Chunk]]:
        """Copy the planned chunks into L1; returns the prefix of `segments` that loaded.

        L3 chunks are first read into L2 slots, all reads in flight at once; a chunk that fails
        its checksum or fingerprint ends the prefix there (the rest is recomputed). Then one
        ranged L2 -> L1 copy moves the whole prefix.
        """
        assert s.bufs is not None
        t0 = time.perf_counter()
        reads: list[tuple[_Chunk, int, Future]] = []
        for src, entry in segments:
            if src != "l3":
                continue
            slot = self._alloc_l2()
            if slot is None:
                break
            reads.append((entry, slot, self.engine.read_l3(entry.key, slot, self.fingerprint)))
        l3_bytes = 0
        ok_l3 = 0
        failed = False
        for entry, slot, fut in reads:
            try:
                if failed:
                    raise StoreError("an earlier chunk of this prefix failed")
                fut.result()
            except (KvbinFormatError, FingerprintMismatch) as exc:
                log.warning("chunk %s unusable (%s); recomputing from there", entry.key.hex(), exc)
                self._n.checksum_failures += isinstance(exc, KvbinFormatError)
                self._set_in_l3(entry, False)
                self._chunks.pop(entry.key, None)
                self._free_slot(slot)
                failed = True
                continue
            except StoreError as exc:
                if not failed:
                    log.warning("L3 read of %s failed: %s", entry.key.hex(), exc)
                self._free_slot(slot)
                failed = True
                continue
            entry.l2_slot = slot
            self._l2_policy.touch(entry.key)
            l3_bytes += self.codec.payload_bytes(entry.tokens)
            ok_l3 += 1
        t_l3 = time.perf_counter() - t0
        if l3_bytes:
            self._throttle_l3(l3_bytes, t_l3)
            t_l3 = time.perf_counter() - t0
        # keep the leading run of segments whose data is now in L2
        usable: list[tuple[str, _Chunk]] = []
        for src, entry in segments:
            if entry.l2_slot is None:
                break
            usable.append((src, entry))
        if not usable:
            return usable
        t1 = time.perf_counter()
        tokens = sum(e.tokens for _, e in usable)
        slots = [e.l2_slot for _, e in usable]
        layers, block = s.bufs.layers, s.bufs.block
        # spin: the forward waits for these bytes, and waking from a blocking wait costs more
        handle = self.engine.restore_range(slots, tokens, layers, 0, block=block)  # type: ignore[arg-type]
        handle.wait(spin=True)
        t_l2 = time.perf_counter() - t1
        for _, e in usable:
            self._l2_policy.touch(e.key)
        l2_bytes = sum(self.codec.payload_bytes(e.tokens) for _, e in usable)
        if ok_l3:
            self._cost.observe_load("l3", l3_bytes, t_l3 + t_l2 * l3_bytes / l2_bytes)
        if ok_l3 < len(usable):
            l2_only = l2_bytes - l3_bytes
            self._cost.observe_load("l2", l2_only, t_l2 * l2_only / l2_bytes)
        return usable

    def _free_slot(self, slot: int) -> None:
        self.engine.forget(slot)
        self.l2.free(slot)

    def _throttle_l3(self, nbytes: int, elapsed: float) -> None:
        rate = self.config.l3_read_bytes_per_s
        if rate:
            time.sleep(max(0.0, nbytes / rate - elapsed))

    # -- commit and the write policies ----------------------------------------------------------

    def _commit(self, s: Session, ids: list[int]) -> None:
        with self._lock:
            if s.state is not SessionState.ACTIVE or s.bufs is None:
                raise SessionError("commit() must follow restore() on the same session")
            self._resolve_prefill(s)
            kv_len = min(s.lengths) if s.lengths else 0
            if len(ids) < kv_len:
                kv_len = len(ids)
            s.tokens = ids[:kv_len]
            s.lengths[:] = [kv_len] * len(s.lengths)
            self._write_completed_chunks(s)
            s.state = SessionState.IDLE
            s.last_active = time.time()

    def _abort(self, s: Session) -> None:
        with self._lock:
            s._prefill = None
            if s.resident:
                s.lengths[:] = [len(s.tokens)] * len(s.lengths)
                s.state = SessionState.IDLE
            elif s.state is SessionState.ACTIVE:
                s.state = SessionState.HIBERNATED

    def _resolve_prefill(self, s: Session) -> None:
        timer, s._prefill = s._prefill, None
        if timer is not None and (secs := timer.seconds()) is not None:
            # The timer spans layer 0 to the last layer's attention; scale for the last layer.
            layers = len(s.lengths)
            self._cost.observe_prefill(timer.tokens, secs * layers / max(1, layers - 1))

    def _write_completed_chunks(self, s: Session, *, evicting: bool = False) -> None:
        """Key every newly completed full chunk and apply the write policy to it."""
        C = self.chunk_tokens
        n_full = len(s.tokens) // C
        parent = s.chunk_keys[-1] if s.chunk_keys else ZERO_KEY
        for i in range(len(s.chunk_keys), n_full):
            toks = s.tokens[i * C : (i + 1) * C]
            parent = self._key_for(parent, toks, s)
            s.chunk_keys.append(parent)
        for i in range(s.flushed, n_full):
            key = s.chunk_keys[i]
            entry = self._chunks.get(key)
            if entry is None:
                entry = self._chunks[key] = _Chunk(
                    key=key, parent=s.chunk_keys[i - 1] if i else ZERO_KEY, tokens=C
                )
                entry.in_l3 = key in self._l3_tokens
            entry.seen += 1
            if entry.l2_slot is not None or entry.in_l3 or entry.l3_write is not None:
                continue  # already stored once (prefix shared with another session)
            policy = self.config.write_policy
            if (
                evicting
                or policy == "write_through"
                or (
                    policy == "write_through_selective"
                    and entry.seen >= self.config.selective_min_hits
                )
            ):
                self._write_down(s, i * C, entry, tenant=s.tenant)
        # Only chunks that were written (or already stored) count as flushed.
        while s.flushed < n_full:
            e = self._chunks.get(s.chunk_keys[s.flushed])
            if e is None or (e.l2_slot is None and not e.in_l3 and e.l3_write is None):
                break
            s.flushed += 1

    def _write_down(self, s: Session, pos: int, entry: _Chunk, *, tenant: str) -> None:
        """L1 -> L2 now (one D2H copy), then L2 -> L3 queued (shed if the queue is full)."""
        assert s.bufs is not None
        slot = self._alloc_l2()
        if slot is None:
            # L2 is all in flight: write straight through a temporary staging buffer.
            log.debug("L2 full of in-flight chunks; chunk %s not cached", entry.key.hex())
            return
        self.engine.offload(s.bufs.layers, pos, entry.tokens, slot, block=s.bufs.block)
        entry.l2_slot = slot
        self._l2_policy.touch(entry.key)
        self._queue_l3_write(entry, tenant)

    def _queue_l3_write(self, entry: _Chunk, tenant: str) -> None:
        if entry.in_l3 or entry.l3_write is not None or entry.l2_slot is None:
            return
        header = self._header(entry, tenant)
        entry.l3_write = self.engine.write_l3(entry.l2_slot, header)  # None: shed (counted)
        if entry.l3_write is not None:
            self._writing.add(entry.key)

    def _header(self, entry: _Chunk, tenant: str) -> ChunkHeader:
        return self.codec.header(
            entry.key,
            entry.tokens,
            fingerprint=self.fingerprint,
            tenant=tenant[:64],
            parent=entry.parent,
        )

    def _reap(self) -> None:
        """Harvest finished background transfers and expired sessions (called under the lock)."""
        for key in list(self._writing):  # only chunks with a write in flight, not every chunk
            entry = self._chunks.get(key)
            fut = entry.l3_write if entry is not None else None
            if fut is not None and not fut.done():
                continue
            self._writing.discard(key)
            if entry is not None and fut is not None:
                entry.l3_write = None
                exc = fut.exception()
                if exc is None:
                    self._set_in_l3(entry, True)
                elif isinstance(exc, StoreFullError):
                    self._n.l3_full += 1
                else:
                    log.warning("L3 write of %s failed: %s", entry.key.hex(), exc)
        now = time.time()
        for s in list(self._sessions.values()):
            if (
                s.ttl_s is not None
                and s.state is not SessionState.ACTIVE
                and now - s.last_active > s.ttl_s
            ):
                self._close(s)

    # -- L1 admission and eviction ----------------------------------------------------------------

    def _alloc_l1(self, s: Session, tokens: int) -> None:
        if s.bufs is not None:
            self._grow(s, tokens)
            return
        need = self.l1.bytes_for(self.l1.round_up(tokens))
        s.bufs = self._with_room(need, lambda: self.l1.allocate(tokens), exclude=s)
        s.lengths = [0] * self.geometry.num_layers

    def _grow(self, s: Session, tokens: int) -> None:
        assert s.bufs is not None
        bufs = s.bufs
        need = self.l1.bytes_for(self.l1.round_up(tokens))
        keep = max(s.lengths) if s.lengths else 0  # layers already written in this forward
        self._with_room(need, lambda: self.l1.grow(bufs, tokens, keep), exclude=s)

    def _with_room(self, need: int, alloc: Any, exclude: Session) -> Any:
        """Run `alloc`, evicting idle sessions (unpinned first, LRU) while L1 is short."""
        with self._lock:
            while True:
                try:
                    if self.l1.free_bytes >= need:
                        return alloc()
                except torch.cuda.OutOfMemoryError:
                    self._n.oom_retries += 1
                    if not self._evict_one(exclude):
                        raise L1BudgetExceeded(
                            "the GPU ran out of memory for L1 and no idle session is left to "
                            "evict; lower l1_bytes or the concurrency"
                        ) from None
                    torch.cuda.empty_cache()
                    continue
                except L1BudgetExceeded:
                    pass
                if not self._evict_one(exclude):
                    raise L1BudgetExceeded(
                        f"L1 budget of {self.l1.budget_bytes} bytes cannot hold {need} more bytes "
                        "even after evicting every idle session; raise l1_bytes or lower the "
                        "number of concurrent requests"
                    )

    def _evict_one(self, exclude: Session) -> bool:
        candidates = [
            s
            for s in self._sessions.values()
            if s.resident and s is not exclude and s.state is not SessionState.ACTIVE
        ]
        if not candidates:
            return False
        victim = min(candidates, key=lambda s: (s.pinned, s.last_active))
        self._hibernate(victim, wait=False)
        self._n.evictions["l1"] += 1
        return True

    def _hibernate(self, s: Session, *, wait: bool) -> None:
        with self._lock:
            if s.state is SessionState.ACTIVE:
                raise SessionError("cannot hibernate a session while a request is running on it")
            if s.resident:
                assert s.bufs is not None
                self._write_completed_chunks(s, evicting=True)
                self._write_tail(s)
                self.l1.release(s.bufs)
                s.bufs, s.lengths = None, []
            s.state = SessionState.HIBERNATED
            if wait:
                self._flush_session(s)
                self._save_record(s)
            else:  # an admission eviction: keep the SQLite commit off the request's path
                self._bg.submit(self.l3.save_session, self._record(s))

    def _write_tail(self, s: Session) -> None:
        C = self.chunk_tokens
        t = len(s.tokens) % C
        if t == 0:
            s.tail_key = None
            return
        parent = s.chunk_keys[-1] if s.chunk_keys else ZERO_KEY
        key = chunk_key(parent, s.tokens[-t:], s.ns)
        s.tail_key = key
        entry = self._chunks.get(key)
        if entry is None:
            entry = self._chunks[key] = _Chunk(key=key, parent=parent, tokens=t)
            entry.in_l3 = key in self._l3_tokens
        if entry.l2_slot is None and not entry.in_l3:
            self._write_down(s, len(s.tokens) - t, entry, tenant=s.tenant)

    def _flush_session(self, s: Session) -> None:
        """Wait until the session's chunks are durable in L3 (or known to be shed)."""
        keys = [*s.chunk_keys] + ([s.tail_key] if s.tail_key else [])
        for key in keys:
            entry = self._chunks.get(key)
            if entry is None:
                continue
            if not entry.in_l3 and entry.l3_write is None and entry.l2_slot is not None:
                self._queue_l3_write(entry, s.tenant)
            if entry.l3_write is not None:
                try:
                    entry.l3_write.result()
                    self._set_in_l3(entry, True)
                except StoreFullError:
                    self._n.l3_full += 1
                except Exception as exc:  # counted by the store; the chunk stays in L2
                    log.warning("L3 write of %s failed: %s", key.hex(), exc)
                entry.l3_write = None
                self._writing.discard(key)

    # -- L2 slots -------------------------------------------------------------------------------

    def _alloc_l2(self) -> int | None:
        slot = self.l2.alloc()
        busy: set[bytes] = set()
        while slot is None:
            victim = self._l2_policy.victim(exclude=busy)
            if victim is None:
                return None
            entry = self._chunks.get(victim)  # type: ignore[call-overload]
            if entry is None or entry.l2_slot is None:
                self._l2_policy.remove(victim)
                continue
            if entry.l3_write is not None and not entry.l3_write.done():
                busy.add(entry.key)
                continue
            self._reap_entry(entry)
            if not entry.in_l3:
                # write-back: the only copy is in L2; make it durable before dropping it
                fut = self.engine.write_l3(entry.l2_slot, self._header(entry, ""))
                if fut is not None:
                    try:
                        fut.result()
                        self._set_in_l3(entry, True)
                    except Exception as exc:
                        log.warning("write-back of %s failed: %s", entry.key.hex(), exc)
            self._free_slot(entry.l2_slot)
            entry.l2_slot = None
            self._l2_policy.remove(victim)
            self._n.evictions["l2"] += 1
            slot = self.l2.alloc()
        return slot

    def _set_in_l3(self, entry: _Chunk, durable: bool) -> None:
        entry.in_l3 = durable
        if durable:
            self._l3_tokens[entry.key] = entry.tokens
        else:
            self._l3_tokens.pop(entry.key, None)

    def _reap_entry(self, entry: _Chunk) -> None:
        fut = entry.l3_write
        if fut is not None and fut.done():
            entry.l3_write = None
            self._writing.discard(entry.key)
            self._set_in_l3(entry, fut.exception() is None)

    # -- prefetch / close -----------------------------------------------------------------------

    def _prefetch(self, s: Session) -> None:
        with self._lock:
            keys = [*s.chunk_keys] + ([s.tail_key] if s.tail_key else [])
            for key in keys:
                entry, src = self._locate(key)
                if entry is None:
                    break
                if src != "l3" or entry.l3_read is not None:
                    continue
                slot = self._alloc_l2()
                if slot is None:
                    break
                entry.l2_slot = slot  # reserved; usable once the read finishes
                entry.l3_read = self.engine.read_l3(key, slot, self.fingerprint)
                self._l2_policy.touch(key)
                self._n.hits["l3"] += 0

    def _finish_prefetch(self, entry: _Chunk) -> None:
        fut, entry.l3_read = entry.l3_read, None
        assert fut is not None
        try:
            fut.result()
        except Exception as exc:
            log.warning("prefetch of %s failed: %s", entry.key.hex(), exc)
            if entry.l2_slot is not None:
                self._free_slot(entry.l2_slot)
                self._l2_policy.remove(entry.key)
            entry.l2_slot = None
            if isinstance(exc, (KvbinFormatError, FingerprintMismatch)):
                self._n.checksum_failures += 1
                self._set_in_l3(entry, False)

    def _close(self, s: Session) -> None:
        with self._lock:
            if s.state is SessionState.ACTIVE:
                raise SessionError("cannot close a session while a request is running on it")
            if s.bufs is not None:
                self.l1.release(s.bufs)
                s.bufs, s.lengths = None, []
            s.state = SessionState.CLOSED
            self._sessions.pop((s.tenant, s.session_id), None)
            # through the record thread, so it lands after any save queued before it
            self._bg.submit(self.l3.delete_session, s.session_id, s.tenant)

    # -- sharing ---------------------------------------------------------------------------------

    def publish_shared(self, input_ids: torch.Tensor | Sequence[int], session: Session) -> int:
        """Publish the full chunks of a resident session's prefix to every tenant.

        Returns the number of chunks published. Use it for system prompts and tool schemas
        that are not secret; everything else stays per tenant.
        """
        ids = _as_list(input_ids)
        with self._lock:
            if not session.resident:
                raise SessionError("publish_shared needs a resident session holding the prefix")
            common = _common_prefix(session.tokens, ids)
            C = self.chunk_tokens
            parent = ZERO_KEY
            n = 0
            for i in range(common // C):
                key = chunk_key(parent, ids[i * C : (i + 1) * C], self._shared_ns)
                entry = self._chunks.get(key)
                if entry is None:
                    entry = self._chunks[key] = _Chunk(key=key, parent=parent, tokens=C)
                    self._write_down(session, i * C, entry, tenant=SHARED_TENANT)
                parent = key
                n += 1
            self._published = True
            return n

    def evict_l2(self) -> int:
        """Drop every L2 copy that is durable in L3 (frees host RAM); returns chunks dropped."""
        with self._lock:
            self.engine.flush()
            self._reap()
            dropped = 0
            for entry in self._chunks.values():
                if entry.l2_slot is not None and entry.in_l3 and entry.l3_read is None:
                    self._free_slot(entry.l2_slot)
                    self._l2_policy.remove(entry.key)
                    entry.l2_slot = None
                    self._n.evictions["l2"] += 1
                    dropped += 1
            return dropped

    # -- lifecycle and stats -------------------------------------------------------------------

    def flush(self) -> None:
        """Wait for every queued L3 write."""
        with self._lock:
            self.engine.flush()
            self._reap()

    def close(self) -> None:
        """Hibernate every resident session to L3, then release every resource. Idempotent."""
        with self._lock:
            if self._closed:
                return
            for s in list(self._sessions.values()):
                if s.state is SessionState.ACTIVE:
                    self._abort(s)
                if s.resident:
                    self._hibernate(s, wait=False)
            self.engine.flush()
            self._reap()
            for s in list(self._sessions.values()):
                if s.state is SessionState.HIBERNATED:
                    self._flush_session(s)
                    self._save_record(s)
            self._closed = True
            self._bg.shutdown(wait=True)
            self.engine.close()
            self.l2.close()
            self.l3.close()

    def __enter__(self) -> TieredCache:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _check_open(self) -> None:
        if self._closed:
            raise SessionError("this TieredCache is closed")

    def _truncate(self, s: Session, n: int) -> None:
        s.tokens = s.tokens[:n]
        s.lengths[:] = [n] * len(s.lengths)
        C = self.chunk_tokens
        del s.chunk_keys[n // C :]
        s.flushed = min(s.flushed, len(s.chunk_keys))
        s.tail_key = None

    def _record_latency(self, src: str, seconds: float) -> None:
        counts = self._n.latency[src]
        for i, bound in enumerate(RESTORE_BUCKETS):
            if seconds <= bound:
                counts[i] += 1
        self._n.latency_sum[src] += seconds
        self._n.latency_count[src] += 1

    def stats(self) -> CacheSnapshot:
        """A frozen snapshot of every tier, session and counter (DESIGN.md section 7)."""
        with self._lock:
            self._reap()
            return build_snapshot(self)


def _common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def _default_l1_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        return free // 2
    return 1 << 30
