"""L4Store: the Redis client of the shared tier, behind a circuit breaker.

Every call goes through `_call`: refused at once while the breaker is open, timed, counted,
and any Redis or socket failure becomes `L4Unavailable` (never anything else), so a caller can
always fall back to L3 or a recompute. A chunk Redis does not hold (expired, evicted under
`maxmemory`, never written) is a miss (`ChunkNotFound`), not an error.

Writes build the whole value under a temp key, then RENAME it over the final key, in one
MULTI/EXEC (kvtier.tiers.l4.keys): a reader sees the old value or the complete new one, and a
connection cut mid-value leaves nothing (Redis runs no part of a transaction it did not get
whole); a temp key left by anything else expires with its TTL.

Reads of many chunks (`get_chunks`) are split over `streams` connections, each one pipelining
its GETs, and every value is verified (kvtier.tiers.l4.codec) before it reaches its sink.

With `sealer` set (an encrypted store, kvtier.tiers.l4.sealed) every chunk value and session
record is sealed on put and opened (its AES-GCM tag verified) on get; a value whose key was
destroyed (crypto-shred) or cannot be found is a miss, one failing its tag is deleted.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Collection, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from typing import TYPE_CHECKING, Any, TypeVar

from kvtier import sealing
from kvtier.errors import (
    AuthenticationFailed,
    ConfigError,
    KvbinFormatError,
    L4Unavailable,
    TenantKeyShredded,
)
from kvtier.kvbin import ChunkHeader
from kvtier.tiers.l3.index import SessionRecord
from kvtier.tiers.l4 import codec, keys, routes
from kvtier.tiers.l4.breaker import CLOSED, Breaker
from kvtier.tiers.l4.reads import ChunkReads

if TYPE_CHECKING:  # pragma: no cover
    from kvtier.tiers.l4.sealed import TenantKeys

log = logging.getLogger("kvtier.tiers.l4")
T = TypeVar("T")


def _array(n: int) -> bytes:
    return b"*%d\r\n" % n


def _bulk(arg: bytes) -> bytes:
    return b"$%d\r\n%s\r\n" % (len(arg), arg)


class L4Store(ChunkReads):
    """Chunks and session records in Redis; see the module docstring."""

    def __init__(
        self,
        url: str,
        *,
        ttl_s: float | None = 86400.0,
        timeout_s: float = 2.0,
        connect_timeout_s: float = 0.5,
        streams: int = 4,
        breaker: Breaker | None = None,
    ) -> None:
        try:
            import redis
        except ImportError:  # pragma: no cover - the l4 extra is missing
            raise ConfigError(
                "l4_url needs the `redis` package: pip install 'kvtier[l4]'"
            ) from None
        self._redis = redis
        self.url = url
        self.shown_url = keys.redact(url)
        # one server's pool, or a Redis Cluster's slot map (kvtier.tiers.l4.routes)
        self._routes = routes.open_routes(
            redis, url, socket_timeout=timeout_s, socket_connect_timeout=connect_timeout_s
        )
        self._stale = False  # a node went away: ask the cluster for its slot map first
        self.shards: list[routes.Shard] = []  # a cluster's primaries, as last pinged
        self._by_shard: dict[str, list[int]] = {}  # primary -> [hits, misses] of its reads
        self.ttl_ms = None if ttl_s is None else max(1, int(ttl_s * 1000))
        self.breaker = breaker or Breaker()
        self.streams = max(1, streams)
        self._lock = threading.Lock()
        self._n = dict.fromkeys(
            (
                "bytes_written",
                "bytes_read",
                "hits",
                "misses",
                "errors",
                "writes_shed",
                "get_count",
                "put_count",
            ),
            0,
        )
        self._secs = {"get_seconds_sum": 0.0, "put_seconds_sum": 0.0}
        self._pool_threads = ThreadPoolExecutor(self.streams, thread_name_prefix="kvtier-l4r")
        self.run_id: str | None = None
        self.memory: dict[str, Any] = {}
        self._closed = False
        self.sealer: TenantKeys | None = None  # set when the store is encrypted

    @property
    def _r(self) -> Any:
        """redis-py's client: `Redis` on one server, `RedisCluster` on a cluster."""
        return self._routes.client

    @property
    def cluster(self) -> bool:
        return self._routes.cluster

    # -- the guarded call ------------------------------------------------------------------------

    def _call(self, what: str, fn: Callable[[], T]) -> T:
        if self._closed:
            raise L4Unavailable("the L4 store is closed")
        if not self.breaker.allow():
            raise L4Unavailable(f"L4 ({self.shown_url}) circuit breaker is open; {what} skipped")
        r = self._redis
        try:
            if self._stale:  # after a node went away (a failover): the slot map, again
                self._routes.refresh()
                self._stale = False
            out = fn()
        except (r.TimeoutError, TimeoutError) as exc:
            self.breaker.failure()
            self.count("errors")
            self._stale = self.cluster
            raise L4Unavailable(f"L4 {what} timed out on {self.shown_url} ({exc})") from exc
        except (r.ConnectionError, OSError) as exc:
            self.breaker.trip()
            self._stale = self.cluster
            self.count("errors")
            raise L4Unavailable(f"L4 {what} failed: {self.shown_url} unreachable ({exc})") from exc
        except r.RedisError as exc:
            # The server answered (OOM under maxmemory noeviction, a read-only replica...):
            # the breaker stays closed, the call is an error for this chunk only.
            self.breaker.success()
            self.count("errors")
            raise L4Unavailable(f"L4 {what} refused by {self.shown_url}: {exc}") from exc
        except BaseException:
            self.breaker.probe_failed()  # a probe ending in anything else still has its verdict
            raise
        self.breaker.success()
        return out

    def count(self, name: str, n: int = 1) -> None:
        with self._lock:
            self._n[name] += n

    def count_shard(self, shard: str, hits: int, misses: int) -> None:
        """Hits and misses of one cluster shard's reads (nothing on one server)."""
        if shard:
            with self._lock:
                n = self._by_shard.setdefault(shard, [0, 0])
                n[0] += hits
                n[1] += misses

    def _timed(self, kind: str, seconds: float, nbytes: int, ops: int = 1) -> None:
        with self._lock:
            self._secs[f"{kind}_seconds_sum"] += seconds
            self._n[f"{kind}_count"] += ops
            self._n["bytes_read" if kind == "get" else "bytes_written"] += nbytes

    # -- health ----------------------------------------------------------------------------------

    def ping(self) -> float:
        """Round trip of a PING in seconds; also refreshes `run_id` and `memory`."""

        def go() -> float:
            if self.cluster:
                return self._ping_cluster()
            t0 = time.perf_counter()
            self._r.ping()
            rtt = time.perf_counter() - t0
            info = self._r.info("server")
            mem = self._r.info("memory")
            self.run_id = str(info.get("run_id", ""))
            self.memory = {k: mem.get(k) for k in ("used_memory", "maxmemory", "maxmemory_policy")}
            return rtt

        return self._call("ping", go)

    def _ping_cluster(self) -> float:
        """PING every primary (the slowest round trip is the answer), and read each shard's
        slots, replicas and memory; `run_id` changes when any primary does (a failover)."""
        assert isinstance(self._routes, routes.Cluster)
        rtt = 0.0
        for node in self._r.get_primaries():
            t0 = time.perf_counter()
            node.redis_connection.ping()
            rtt = max(rtt, time.perf_counter() - t0)
        self.shards = self._routes.shards()
        self.run_id = ",".join(s.run_id for s in self.shards)
        self.memory = {
            "used_memory": sum(s.used_memory for s in self.shards),
            "maxmemory": sum(s.maxmemory for s in self.shards),
        }
        return rtt

    @property
    def up(self) -> bool:
        return self.breaker.state == CLOSED and not self._closed

    # -- chunks ----------------------------------------------------------------------------------

    def put_chunk(self, header: ChunkHeader, payload: Any) -> int:
        """Store one chunk; returns the bytes sent. The value goes under a temp key, which is
        RENAMEd over the chunk's key in the same MULTI/EXEC. Sealed first when the store is
        encrypted (the caller's payload stays plain)."""
        if self.sealer is not None:
            header, payload = self.sealer.seal(header, payload)
        head, view = codec.chunk_parts(header, payload)
        final = keys.chunk(header.key)
        t0 = time.perf_counter()
        self._call("put", lambda: self._moved_retry(lambda: self._set_renamed(final, head, view)))
        nbytes = len(head) + len(view)
        self._timed("put", time.perf_counter() - t0, nbytes)
        return nbytes

    def _moved_retry(self, fn: Callable[[], T]) -> T:
        """`fn()`, once more after a MOVED (the slot's primary changed: a failover, a reshard)
        with the slot map asked again. An ASK (the slot is being migrated) is not followed for a
        write, whose temp key and RENAME the importing node would refuse: the write fails for
        this chunk (L4Unavailable), the breaker stays closed."""
        epoch = self._routes.epoch
        try:
            return fn()
        except self._redis.exceptions.MovedError:
            self._routes.refresh(epoch)
            return fn()

    def _set_renamed(self, final: str, *parts: Any) -> None:
        """MULTI, SET <temp> <parts joined> PX ttl, RENAME <temp> <final>, EXEC.

        Packed here rather than by redis-py's pipeline so that the value's parts (the 4 KiB
        header and the payload, in the caller's buffer) go to the socket as they are: joining
        them first costs a copy of the whole chunk, a fifth of a loopback SET's time at 14 MB.
        """
        tmp = keys.temp(final)
        size = sum(len(p) for p in parts)
        px = [] if self.ttl_ms is None else [b"PX", str(self.ttl_ms).encode()]
        set_args = [b"SET", tmp.encode()]
        packed = [b"*1\r\n$5\r\nMULTI\r\n"]
        packed.append(_array(len(set_args) + 1 + len(px)) + b"".join(map(_bulk, set_args)))
        packed.append(b"$%d\r\n" % size)
        packed.extend(parts)
        packed.append(b"\r\n" + b"".join(map(_bulk, px)))
        packed.append(_array(3) + b"".join(map(_bulk, (b"RENAME", tmp.encode(), final.encode()))))
        packed.append(b"*1\r\n$4\r\nEXEC\r\n")
        pool = self._routes.pool_for(final)
        conn = pool.get_connection()
        try:
            conn.send_packed_command(packed, check_health=False)
            replies = [conn.read_response() for _ in range(4)]  # OK, QUEUED, QUEUED, [..]
            done = replies[3]
            if not isinstance(done, list) or len(done) != 2:
                raise self._redis.ResponseError(f"unexpected EXEC reply {done!r:.80}")
            for r in done:
                if isinstance(r, Exception):
                    raise r
        except BaseException:
            conn.disconnect()  # replies may be left unread: never reuse the connection
            raise
        finally:
            pool.release(conn)

    def exists(self, chunk_keys: Sequence[bytes]) -> list[bool]:
        """Which of `chunk_keys` Redis holds now (one pipelined round trip). With a TTL, the
        ones it holds get their TTL renewed (PEXPIRE), so they outlive a record naming them."""
        if not chunk_keys:
            return []

        def go() -> list[Any]:
            with self._r.pipeline(transaction=False) as p:
                for k in chunk_keys:
                    if self.ttl_ms is None:
                        p.exists(keys.chunk(k))
                    else:
                        p.pexpire(keys.chunk(k), self.ttl_ms)
                return list(p.execute())

        return [bool(x) for x in self._call("exists", go)]

    def delete_chunk(self, key: bytes) -> None:
        self._call("delete", lambda: self._r.delete(keys.chunk(key)))

    # -- tenant data keys (sealed.TenantKeys) -----------------------------------------------------

    def put_tenant_key(self, tenant: str, key_id: bytes, value: bytes) -> None:
        """HSET `value` (a wrapped data key) as `key_id` in the tenant's hash and renew the
        hash's TTL, in one MULTI/EXEC; through the breaker (L4Unavailable on trouble)."""
        name = keys.tenant_keys(tenant)

        def go() -> None:
            with self._routes.node(name).pipeline(transaction=True) as p:
                p.hset(name, key_id.hex(), value)
                if self.ttl_ms is not None:
                    p.pexpire(name, self.ttl_ms)
                p.execute()

        self._call("key put", lambda: self._moved_retry(go))

    def get_tenant_key(self, tenant: str, key_id: bytes) -> bytes | None:
        """The value `put_tenant_key` stored for `key_id` of `tenant`, or None; through the
        breaker (L4Unavailable on trouble)."""
        name = keys.tenant_keys(tenant)
        value: Any = self._call("key get", lambda: self._r.hget(name, key_id.hex()))
        return None if value is None else bytes(value)

    # -- session records -------------------------------------------------------------------------

    def put_record(self, rec: SessionRecord) -> None:
        """Store a session record (its token ids sealed when the store is encrypted)."""
        if self.sealer is not None and rec.key_id is None:
            key = self.sealer.for_tenant(rec.tenant)
            sealed = sealing.seal_record(key, rec.session_id, rec.fingerprint, bytes(rec.token_ids))
            rec = replace(rec, token_ids=sealed, key_id=key.key_id)
        value = codec.pack_record(rec)
        final = keys.record(rec.fingerprint, rec.tenant, rec.session_id)

        def go() -> None:
            tmp = keys.temp(final)
            with self._routes.node(final).pipeline(transaction=True) as p:
                p.set(tmp, value, px=self.ttl_ms)
                p.rename(tmp, final)
                p.execute()

        self._call("record put", lambda: self._moved_retry(go))

    def get_record(self, fingerprint: bytes, tenant: str, session_id: str) -> SessionRecord | None:
        """The session's record, or None (none stored, or a damaged one, which is deleted)."""
        final = keys.record(fingerprint, tenant, session_id)
        value: Any = self._call("record get", lambda: self._r.get(final))
        if value is None:
            return None
        try:
            rec = codec.unpack_record(value)
        except KvbinFormatError as exc:
            self.count("errors")
            log.warning("L4 session record %s is damaged (%s); deleted", final, exc)
            self._call("record delete", lambda: self._r.delete(final))
            return None
        if (rec.fingerprint, rec.tenant, rec.session_id) != (fingerprint, tenant, session_id):
            self.count("errors")
            return None  # a digest collision or a planted value: never another's session
        return self._open_record(final, rec)

    def _open_record(self, final: str, rec: SessionRecord) -> SessionRecord | None:
        """The record with its token ids opened; None if it cannot be (a tag failure or a
        plain record in an encrypted store: deleted; a destroyed key: left, a miss)."""
        if self.sealer is None:
            if rec.key_id is not None:
                log.info("L4 session record %s is sealed; this store is not encrypted", final)
                return None
            return rec
        try:
            if rec.key_id is None:
                raise AuthenticationFailed("a plain session record where records are sealed")
            key = self.sealer.by_id(rec.key_id, rec.tenant, fresh=True)
            data = sealing.open_record(key, rec.session_id, rec.fingerprint, rec.token_ids)
        except TenantKeyShredded as exc:
            log.info("L4 session record %s is not readable here (%s)", final, exc)
            return None
        except AuthenticationFailed as exc:
            self.count("errors")
            log.warning("L4 session record %s failed to open (%s); deleted", final, exc)
            self._call("record delete", lambda: self._r.delete(final))
            return None
        return replace(rec, token_ids=data, key_id=None)

    def delete_record(self, fingerprint: bytes, tenant: str, session_id: str) -> None:
        final = keys.record(fingerprint, tenant, session_id)
        self._call("record delete", lambda: self._r.delete(final))

    # -- crypto-shred ----------------------------------------------------------------------------

    def shred_tenant(self, tenant: str, fingerprint: bytes, chunk_keys: Collection[bytes],
                     session_ids: Collection[str]) -> int:  # fmt: skip
        """Delete the tenant's data keys, and the chunks and records named, from Redis (one
        pipeline, one key per command); returns the keys deleted. Best effort: raises
        L4Unavailable while Redis is down or the breaker is open."""
        names = [keys.tenant_keys(tenant)]
        names += [keys.record(fingerprint, tenant, sid) for sid in session_ids]
        names += [keys.chunk(k) for k in chunk_keys]

        def go() -> int:
            with self._r.pipeline(transaction=False) as p:
                for name in names:
                    p.delete(name)
                return sum(int(n) for n in p.execute())

        return self._call("shred", go)

    # -- stats, lifetime -------------------------------------------------------------------------

    def stats(self) -> dict[str, Any]:
        """The contract of `CacheSnapshot.l4` (docs/architecture.md, "L4")."""
        with self._lock:
            n = dict(self._n)
            secs = dict(self._secs)
            by_shard = {k: list(v) for k, v in self._by_shard.items()}
            shards = list(self.shards)
        return {
            "up": self.up,
            "breaker": self.breaker.state,
            "bytes_written": n["bytes_written"],
            "bytes_read": n["bytes_read"],
            "hits": n["hits"],
            "misses": n["misses"],
            "errors": n["errors"],
            "writes_shed": n["writes_shed"],
            "get_seconds_sum": secs["get_seconds_sum"],
            "get_count": n["get_count"],
            "put_seconds_sum": secs["put_seconds_sum"],
            "put_count": n["put_count"],
            "url": self.shown_url,
            # a cluster's primaries (as last pinged) and their reads; [] on one server
            "shards": [
                {
                    "shard": s.name,
                    "slots": s.slots,
                    "replicas": s.replicas,
                    "hits": by_shard.get(s.name, [0, 0])[0],
                    "misses": by_shard.get(s.name, [0, 0])[1],
                }
                for s in shards
            ],
        }

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._pool_threads.shutdown(wait=True)
        self._routes.disconnect()
