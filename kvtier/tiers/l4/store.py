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
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, TypeVar

from kvtier import sealing
from kvtier.errors import (
    AuthenticationFailed,
    ChunkNotFound,
    ConfigError,
    FingerprintMismatch,
    KvbinFormatError,
    L4Unavailable,
    MasterKeyRequired,
    TenantKeyShredded,
)
from kvtier.kvbin import ChunkHeader
from kvtier.tiers.l3.index import SessionRecord
from kvtier.tiers.l4 import codec, keys, wire
from kvtier.tiers.l4.breaker import CLOSED, Breaker
from kvtier.tiers.l4.wire import Dest

if TYPE_CHECKING:  # pragma: no cover
    from kvtier.tiers.l4.sealed import TenantKeys

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


def _array(n: int) -> bytes:
    return b"*%d\r\n" % n


def _bulk(arg: bytes) -> bytes:
    return b"$%d\r\n%s\r\n" % (len(arg), arg)


class L4Store:
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
        try:
            self._pool = redis.ConnectionPool.from_url(
                url,
                socket_timeout=timeout_s,
                socket_connect_timeout=connect_timeout_s,
                health_check_interval=0,
            )
        except ValueError as exc:
            raise ConfigError(
                f"l4_url {self.shown_url!r} is not a Redis URL ({exc}); use redis://host:port/db"
            ) from None
        self._r = redis.Redis(connection_pool=self._pool)
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

    # -- the guarded call ------------------------------------------------------------------------

    def _call(self, what: str, fn: Callable[[], T]) -> T:
        if self._closed:
            raise L4Unavailable("the L4 store is closed")
        if not self.breaker.allow():
            raise L4Unavailable(f"L4 ({self.shown_url}) circuit breaker is open; {what} skipped")
        r = self._redis
        try:
            out = fn()
        except (r.TimeoutError, TimeoutError) as exc:
            self.breaker.failure()
            self.count("errors")
            raise L4Unavailable(f"L4 {what} timed out on {self.shown_url} ({exc})") from exc
        except (r.ConnectionError, OSError) as exc:
            self.breaker.trip()
            self.count("errors")
            raise L4Unavailable(f"L4 {what} failed: {self.shown_url} unreachable ({exc})") from exc
        except r.RedisError as exc:
            # The server answered (OOM under maxmemory noeviction, a read-only replica...):
            # the breaker stays closed, the call is an error for this chunk only.
            self.breaker.success()
            self.count("errors")
            raise L4Unavailable(f"L4 {what} refused by {self.shown_url}: {exc}") from exc
        self.breaker.success()
        return out

    def count(self, name: str, n: int = 1) -> None:
        with self._lock:
            self._n[name] += n

    def _timed(self, kind: str, seconds: float, nbytes: int, ops: int = 1) -> None:
        with self._lock:
            self._secs[f"{kind}_seconds_sum"] += seconds
            self._n[f"{kind}_count"] += ops
            self._n["bytes_read" if kind == "get" else "bytes_written"] += nbytes

    # -- health ----------------------------------------------------------------------------------

    def ping(self) -> float:
        """Round trip of a PING in seconds; also refreshes `run_id` and `memory`."""

        def go() -> float:
            t0 = time.perf_counter()
            self._r.ping()
            rtt = time.perf_counter() - t0
            info = self._r.info("server")
            mem = self._r.info("memory")
            self.run_id = str(info.get("run_id", ""))
            self.memory = {k: mem.get(k) for k in ("used_memory", "maxmemory", "maxmemory_policy")}
            return rtt

        return self._call("ping", go)

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
        self._call("put", lambda: self._set_renamed(final, head, view))
        nbytes = len(head) + len(view)
        self._timed("put", time.perf_counter() - t0, nbytes)
        return nbytes

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
        conn = self._pool.get_connection()
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
            self._pool.release(conn)

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
        n = min(self.streams, len(chunk_keys))
        groups = [list(range(i, len(chunk_keys), n)) for i in range(n)]
        left = [n]

        def stream(idx: list[int]) -> None:
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
                self._stream(idx, chunk_keys, fingerprint, dest, tenants, finish, batch, exp)
            except BaseException as exc:  # every future of the group settles, whatever happens
                finish(0)
                for i in idx:
                    if not batch.futures[i].done():
                        batch.futures[i].set_exception(exc)

        for g in groups:
            try:
                self._pool_threads.submit(stream, g)
            except RuntimeError:  # closed meanwhile
                stream_error = L4Unavailable("the L4 store is closed")
                for i in g:
                    batch.futures[i].set_exception(stream_error)
        return batch

    def _stream(
        self,
        idx: list[int],
        chunk_keys: Sequence[bytes],
        fingerprint: bytes,
        dest: Dest,
        tenants: Collection[str] | None,
        finish: Callable[[int], None],
        batch: ReadBatch,
        expect: Sequence[ChunkHeader | None] | None = None,
    ) -> None:
        names = [keys.chunk(chunk_keys[i]) for i in idx]
        mine = [chunk_keys[i] for i in idx]

        def go() -> list[wire.Reply]:
            conn = self._pool.get_connection()
            try:
                return wire.get_many(
                    conn,
                    names,
                    mine,
                    fingerprint,
                    tenants,
                    lambda j, h: dest(idx[j], h),
                    self._redis.ResponseError,
                    None if self.sealer is None else self.sealer.opener,
                    expect,
                )
            except BaseException:
                conn.disconnect()  # replies may be left unread: never reuse the connection
                raise
            finally:
                self._pool.release(conn)

        t0 = time.perf_counter()
        try:
            replies = self._call("get", go)
        except L4Unavailable as exc:
            finish(0)
            for i in idx:
                batch.futures[i].set_exception(exc)
            return
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

    # -- tenant data keys (sealed.TenantKeys) -----------------------------------------------------

    def put_tenant_key(self, tenant: str, key_id: bytes, value: bytes) -> None:
        """HSET `value` (a wrapped data key) as `key_id` in the tenant's hash and renew the
        hash's TTL, in one MULTI/EXEC; through the breaker (L4Unavailable on trouble)."""
        name = keys.tenant_keys(tenant)

        def go() -> None:
            with self._r.pipeline(transaction=True) as p:
                p.hset(name, key_id.hex(), value)
                if self.ttl_ms is not None:
                    p.pexpire(name, self.ttl_ms)
                p.execute()

        self._call("key put", go)

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
            with self._r.pipeline(transaction=True) as p:
                p.set(tmp, value, px=self.ttl_ms)
                p.rename(tmp, final)
                p.execute()

        self._call("record put", go)

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
        }

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._pool_threads.shutdown(wait=True)
        self._pool.disconnect()
