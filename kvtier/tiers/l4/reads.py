"""The read path of L4Store (kvtier.tiers.l4.store): `get_chunks` splits a read of many chunks
over pipelined connections (per shard on a Redis Cluster, up to `streams` per shard), each
read by kvtier.tiers.l4.wire straight into its destination and verified; a GET answered MOVED or
ASK (a cluster's slot moved, or is moving) is sent again where the cluster says the key is."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Collection, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

from kvtier.errors import (
    ChunkNotFound,
    FingerprintMismatch,
    KvbinFormatError,
    L4Unavailable,
    MasterKeyRequired,
    TenantKeyShredded,
)
from kvtier.kvbin import ChunkHeader
from kvtier.tiers.l4 import keys, wire
from kvtier.tiers.l4.routes import Cluster, Single
from kvtier.tiers.l4.wire import Dest

log = logging.getLogger("kvtier.tiers.l4")
T = TypeVar("T")


@dataclass
class ReadBatch:
    """One `get_chunks` call: a future per key, and the bytes and seconds it took."""

    futures: list[Future[ChunkHeader]]
    started: float
    nbytes: int = 0
    finished: float = 0.0

    @property
    def seconds(self) -> float:
        return max(0.0, self.finished - self.started)


class ChunkReads:
    """`get_chunks`, mixed into L4Store, whose guarded call, counters and routes it uses."""

    _redis: Any
    _routes: Single | Cluster
    _lock: threading.Lock
    _pool_threads: ThreadPoolExecutor
    streams: int
    sealer: Any

    if TYPE_CHECKING:  # pragma: no cover - L4Store's

        def _call(self, what: str, fn: Callable[[], T]) -> T: ...
        def count(self, name: str, n: int = 1) -> None: ...
        def count_shard(self, shard: str, hits: int, misses: int) -> None: ...
        def _timed(self, kind: str, seconds: float, nbytes: int, ops: int = 1) -> None: ...
        def delete_chunk(self, key: bytes) -> None: ...

    def get_chunks(
        self,
        chunk_keys: Sequence[bytes],
        fingerprint: bytes,
        dest: Dest,
        tenants: Collection[str] | None = None,
        expect: Sequence[ChunkHeader | None] | None = None,
    ) -> ReadBatch:
        """Start reading `chunk_keys`, `streams` pipelines in parallel; returns at once.

        `dest(i, header)` names where chunk i's payload goes (kvtier.tiers.l4.wire reads it
        there straight from the socket). `expect[i]`, when given, is the header of the chunk
        the caller asked for: a value whose header says other tokens, geometry, codec, payload
        length or tenant is damaged and never read into `dest`. Each future yields the
        chunk's verified header once its payload is there, or fails with ChunkNotFound (a
        miss), KvbinFormatError or FingerprintMismatch (a damaged, forged or foreign value, or
        one failing its AES-GCM tag, deleted from Redis) or L4Unavailable. A sealed value
        whose data key is gone (crypto-shred) or that this host cannot open is a miss
        (ChunkNotFound), left alone."""
        batch = ReadBatch([Future() for _ in chunk_keys], time.perf_counter())
        if not chunk_keys:
            batch.finished = batch.started
            return batch
        names = [keys.chunk(k) for k in chunk_keys]
        try:  # by shard on a cluster (its slot map may need asking first)
            groups = self._call("get", lambda: self._routes.groups(names, self.streams))
        except L4Unavailable as exc:
            batch.finished = time.perf_counter()
            for fut in batch.futures:
                fut.set_exception(exc)
            return batch
        left = [len(groups)]

        def stream(pool: Any, idx: list[int]) -> None:
            ended = [False]

            def finish(nbytes: int) -> None:
                """The group's bytes are in: count them, and end the batch's clock with the
                last group (before any future settles, so a waiter sees the timing)."""
                with self._lock:
                    if ended[0]:
                        return
                    ended[0] = True
                    batch.nbytes += nbytes
                    left[0] -= 1
                    if left[0] == 0:
                        batch.finished = time.perf_counter()

            try:
                exp = None if expect is None else [expect[i] for i in idx]
                self._stream(pool, idx, chunk_keys, fingerprint, dest, tenants, finish, batch,
                             exp)  # fmt: skip
            except BaseException as exc:  # every future of the group settles, whatever happens
                finish(0)
                for i in idx:
                    if not batch.futures[i].done():
                        batch.futures[i].set_exception(exc)

        for pool, g in groups:
            try:
                self._pool_threads.submit(stream, pool, g)
            except RuntimeError:  # closed meanwhile
                stream_error = L4Unavailable("the L4 store is closed")
                for i in g:
                    batch.futures[i].set_exception(stream_error)
        return batch

    def _stream(
        self,
        pool: Any,
        idx: list[int],
        chunk_keys: Sequence[bytes],
        fingerprint: bytes,
        dest: Dest,
        tenants: Collection[str] | None,
        finish: Callable[[int], None],
        batch: ReadBatch,
        expect: Sequence[ChunkHeader | None] | None = None,
    ) -> None:

        def go(pool: Any, js: list[int], asking: bool = False) -> list[wire.Reply]:
            conn = pool.get_connection()
            try:
                return wire.get_many(
                    conn,
                    [keys.chunk(chunk_keys[idx[j]]) for j in js],
                    [chunk_keys[idx[j]] for j in js],
                    fingerprint,
                    tenants,
                    lambda k, h: dest(idx[js[k]], h),
                    self._redis.ResponseError,
                    None if self.sealer is None else self.sealer.opener,
                    None if expect is None else [expect[j] for j in js],
                    asking,
                )
            except BaseException:
                conn.disconnect()  # replies may be left unread: never reuse the connection
                raise
            finally:
                pool.release(conn)

        def follow(replies: list[wire.Reply]) -> list[wire.Reply]:
            """GETs answered MOVED (the map is asked again) or ASK (ASKING at the node named)
            are sent again once, where the cluster says the key is now."""
            for j, rep in enumerate(replies):
                word, _, where = str(rep.error or "").partition(" ")
                if word not in ("MOVED", "ASK") or not isinstance(rep.error, Exception):
                    continue
                if word == "MOVED":
                    self._routes.refresh(epoch)
                    to = self._routes.pool_for(keys.chunk(chunk_keys[idx[j]]))
                else:
                    to = self._routes.pool_at(where.rpartition(" ")[2])
                if to is not None:
                    replies[j] = go(to, [j], asking=word == "ASK")[0]
            return replies

        t0 = time.perf_counter()
        epoch = self._routes.epoch
        try:
            replies = self._call("get", lambda: follow(go(pool, list(range(len(idx))))))
        except L4Unavailable as exc:
            finish(0)
            for i in idx:
                batch.futures[i].set_exception(exc)
            return
        shard = self._routes.shard_of(keys.chunk(chunk_keys[idx[0]]))
        found = sum(r.error is None and r.header is not None for r in replies)
        self.count_shard(shard, found, sum(r.error is None and r.header is None for r in replies))
        got = sum(r.size for r in replies if r.error is None and r.header is not None)
        finish(got)
        self._timed("get", time.perf_counter() - t0, got, len(idx))
        for i, rep in zip(idx, replies, strict=True):
            key = chunk_keys[i]
            fut = batch.futures[i]
            if isinstance(rep.error, (TenantKeyShredded, MasterKeyRequired)):
                self.count("misses")  # sealed under a key this host cannot have: a miss
                log.info("L4 chunk %s is not readable here (%s)", key.hex(), rep.error)
                fut.set_exception(ChunkNotFound(f"chunk {key.hex()} in L4: {rep.error}"))
                continue
            if rep.error is not None:
                self.count("errors")
                if isinstance(rep.error, (KvbinFormatError, FingerprintMismatch)):
                    log.warning("L4 chunk %s is unusable (%s); deleted", key.hex(), rep.error)
                    try:
                        self.delete_chunk(key)
                    except L4Unavailable:
                        pass
                    fut.set_exception(rep.error)
                else:
                    fut.set_exception(L4Unavailable(f"L4 get of {key.hex()}: {rep.error}"))
                continue
            if rep.header is None:
                self.count("misses")
                fut.set_exception(ChunkNotFound(f"chunk {key.hex()} is not in L4"))
                continue
            self.count("hits")
            fut.set_result(rep.header)
