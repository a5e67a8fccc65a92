"""Session: one conversation's handle on a TieredCache (the public per-session API)."""

from __future__ import annotations

import operator
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Protocol, overload

import torch

from kvtier.cache.keys import namespace
from kvtier.errors import SessionError
from kvtier.snapshot import SessionInfo
from kvtier.tiers.l1 import SessionBuffers
from kvtier.types import RestoreSource, SessionState

if TYPE_CHECKING:  # pragma: no cover
    from kvtier.cache.config import CacheConfig
    from kvtier.cache.restoreplan import StagedPrefix
    from kvtier.geometry import KVGeometry
    from kvtier.integrations.hf import KvtierCache
    from kvtier.integrations.paged_cache import PagedCache
    from kvtier.paged.pool import PagePool


Ids = tuple[int, ...]
"""Token ids as the cache keeps them (a session's `tokens`, a restore's plan). A tuple cannot
change under a session, and Python's cyclic garbage collector stops walking a tuple of ints
after its first collection (it untracks it); a list of a session's 3,000 ids stayed tracked,
and every collection that reached it visited each id: 256 such sessions are 768,000 references
for each full collection (docs/benchmarks-history.md, "What the collector walks")."""


class SessionHost(Protocol):
    """What a `Session` needs from its cache (`TieredCache` implements it)."""

    config: CacheConfig

    @property
    def fingerprint(self) -> bytes: ...
    @property
    def chunk_tokens(self) -> int: ...
    @property
    def geometry(self) -> KVGeometry: ...

    def restore_session(self, s: Session, ids: Ids) -> KvtierCache: ...
    def restore_into(self, s: Session, ids: Ids, pool: PagePool) -> PagedCache: ...
    def commit_session(self, s: Session, ids: Ids) -> None: ...
    def abort_session(self, s: Session) -> None: ...
    def hibernate_session(self, s: Session, *, wait: bool = True) -> None: ...
    def prefetch_session(self, s: Session) -> None: ...
    def close_session(self, s: Session) -> None: ...
    def grow_session(self, s: Session, tokens: int) -> None: ...
    def chunk_counts(self, keys: list[bytes]) -> tuple[int, int]: ...


class _PrefillTimer:
    """Times a prefill with CUDA events (no sync in the forward) or the host clock on CPU."""

    def __init__(self, tokens: int, cuda: bool) -> None:
        self.tokens = tokens
        self._cuda = cuda
        self._end: Any = None
        if cuda:
            self._start: Any = torch.cuda.Event(enable_timing=True)
            self._start.record()
        else:
            self._start = time.perf_counter()

    def stop(self) -> None:
        if self._end is not None:
            return
        if self._cuda:
            self._end = torch.cuda.Event(enable_timing=True)
            self._end.record()
        else:
            self._end = time.perf_counter()

    def seconds(self) -> float | None:
        if self._end is None:
            return None
        if self._cuda:
            self._end.synchronize()
            return float(self._start.elapsed_time(self._end)) / 1000.0
        return float(self._end - self._start)


class Session:
    """One conversation's KV. Get it with `TieredCache.session(id, tenant=...)`."""

    def __init__(self, cache: SessionHost, session_id: str, tenant: str) -> None:
        self._cache = cache
        self.session_id = session_id
        self.tenant = tenant
        self.ns = namespace(cache.fingerprint, tenant)
        self.state = SessionState.IDLE
        self.pinned = False
        self.ttl_s: float | None = cache.config.session_ttl_s
        self.last_active = time.time()
        self.tokens: Ids = ()  # ids whose KV is in L1 (resident) or stored (hibernated)
        self.chunk_keys: list[bytes] = []  # keys of full chunks of self.tokens, in order
        self.tail_key: bytes | None = None  # partial chunk written at hibernation
        self.flushed = 0  # leading full chunks already handed to the write policy
        self.bufs: SessionBuffers | None = None
        # idle with its K/V in a batch's page pool (paged L1), stored in L2/L3 as well; the
        # batch tells the cache when those pages go (`TieredCache.pages_dropped`)
        self.in_pages = False
        # a staged restore's prefix, pinned in L2 until the batch copied it into its pages
        # (`TieredCache.restore_staged`)
        self.staged: StagedPrefix | None = None
        # its K/V in pages of a caller's pool (`restore(ids, pool=)`, kvtier.cache.pages), and
        # the first token of the chunk its next commit stores from
        self.pages: PagedCache | None = None
        self.pages_start = 0
        self.lengths: list[int] = []
        self.restore_source = RestoreSource.RECOMPUTE.value
        self._prefill: _PrefillTimer | None = None

    # -- L1Owner protocol (used by KvtierLayer during the model's forward) ----------------------

    def ensure_capacity(self, tokens: int) -> None:
        assert self.bufs is not None
        self._cache.grow_session(self, tokens)

    def on_forward(self, layer_idx: int, new_tokens: int) -> None:
        """Time the first multi-token forward after a restore: that is the prefill."""
        if new_tokens <= 1:
            return
        if layer_idx == 0 and self._prefill is None and self.bufs is not None:
            self._prefill = _PrefillTimer(new_tokens, self.bufs.layers[0][0].is_cuda)
        elif layer_idx == len(self.lengths) - 1 and self._prefill is not None:
            self._prefill.stop()

    # -- public API -----------------------------------------------------------------------------

    @overload
    def restore(self, input_ids: torch.Tensor | Sequence[int]) -> KvtierCache: ...
    @overload
    def restore(self, input_ids: torch.Tensor | Sequence[int], *, pool: PagePool) -> PagedCache: ...
    def restore(
        self,
        input_ids: torch.Tensor | Sequence[int],
        *,
        pool: PagePool | None = None,
    ) -> KvtierCache | PagedCache:
        """A transformers Cache holding the longest cached prefix of `input_ids`.

        At least the last input token is left to compute, so the model produces its logits.
        `pool`: the session's K/V lives in pages of this `kvtier.paged.PagePool` instead of
        L1 buffers, and the Cache is a view over them (`PagedCache`; kvtier.cache.pages).
        """
        if pool is not None:
            return self._cache.restore_into(self, as_ids(input_ids), pool)
        return self._cache.restore_session(self, as_ids(input_ids))

    def commit(self, token_ids: torch.Tensor | Sequence[int]) -> None:
        """Record which token ids the session's KV now covers (prompt + generated)."""
        self._cache.commit_session(self, as_ids(token_ids))

    def abort(self) -> None:
        """Forget KV written since the last commit (a failed or cancelled request)."""
        self._cache.abort_session(self)

    def hibernate(self) -> None:
        """Push the KV down to L2/L3 and free L1 (the agent is waiting on a tool)."""
        self._cache.hibernate_session(self, wait=True)

    def prefetch(self) -> None:
        """Start loading the session's chunks from L3 into L2 (the tool call is returning)."""
        self._cache.prefetch_session(self)

    def pin(self, pinned: bool = True) -> None:
        """Pinned sessions are evicted from L1 last."""
        self.pinned = pinned

    def ttl(self, seconds: float | None) -> None:
        """Close the session automatically after `seconds` without activity (None: never)."""
        self.ttl_s = seconds

    def close(self) -> None:
        """Forget the session: free its L1 and its record (shared chunks stay cached)."""
        self._cache.close_session(self)

    # -- its state (kvtier.types.SessionState): changed only here, under the cache's guard -------

    def begin_turn(self) -> None:
        """A request starts on it (the first phase of its restore): ACTIVE until the turn is
        committed (`end_turn`) or aborted (`abort_turn`). Never while a request runs on it or
        once it is closed (`Restorer.check_restorable` refuses those first)."""
        if self.state in (SessionState.ACTIVE, SessionState.CLOSED):
            raise SessionError(
                f"session {self.session_id[:64]!r} cannot start a turn: {self.state.value}"
            )
        self.state = SessionState.ACTIVE
        self.last_active = time.time()

    def end_turn(self, *, in_pages: bool = False) -> None:
        """Its turn is committed: IDLE, its K/V in L1, or (`in_pages`) in a batch's page pool
        and stored in L2/L3 as well (`SessionLifecycle.commit_pages`)."""
        if self.state is not SessionState.ACTIVE:
            raise SessionError(
                f"session {self.session_id[:64]!r} has no turn to end: {self.state.value}"
            )
        self.state = SessionState.IDLE
        self.in_pages = in_pages
        self.last_active = time.time()

    def abort_turn(self) -> None:
        """Its turn ends with nothing committed (an abort, a failed restore): IDLE while L1
        holds its K/V, else HIBERNATED (what is stored is all it has)."""
        if self.state is SessionState.CLOSED:
            raise SessionError(f"session {self.session_id[:64]!r} is closed")
        self.state = SessionState.IDLE if self.resident else SessionState.HIBERNATED

    def hibernated(self) -> None:
        """Its K/V is in L2/L3 (and L4) alone: nothing in L1 nor in a batch's pages."""
        self.state = SessionState.HIBERNATED
        self.in_pages = False

    def closed(self) -> None:
        """Forgotten for good: a new turn needs `TieredCache.session` again. Never while a
        request runs on it (closing and shredding refuse that first)."""
        if self.state is SessionState.ACTIVE:
            raise SessionError(f"session {self.session_id[:64]!r} has a request running")
        self.state = SessionState.CLOSED

    # -- the cache's changes to the session (under the cache's guard) ----------------------------

    def truncate(self, n: int) -> None:
        """Keep the first `n` tokens. The stored partial tail stays its own when nothing is
        cut (a turn that then fails still restores it)."""
        if n < len(self.tokens):
            self.tail_key = None
        self.tokens = self.tokens[:n]
        self.lengths[:] = [n] * len(self.lengths)
        del self.chunk_keys[n // self._cache.chunk_tokens :]
        self.flushed = min(self.flushed, len(self.chunk_keys))

    def cut(self, n: int) -> None:
        """Keep only the first `n` tokens (a multiple of the chunk size), its tail dropped."""
        self.truncate(n)
        self.tail_key = None

    def drop_pages(self) -> None:
        """Its pages in a caller's pool, if any, go back to the pool."""
        view = self.pages
        if view is not None:
            view.pool.release(view.table)
            self.pages = None
            self.in_pages = False

    def take_prefill(self) -> _PrefillTimer | None:
        """The timer of the forward since the last commit, if any (cleared)."""
        timer, self._prefill = self._prefill, None
        return timer

    @property
    def resident(self) -> bool:
        return self.bufs is not None

    def info(self) -> SessionInfo:
        return self._info(self._cache.chunk_counts(self._keys()))

    def _keys(self) -> list[bytes]:
        return [*self.chunk_keys] + ([self.tail_key] if self.tail_key else [])

    def _info(self, counts: tuple[int, int]) -> SessionInfo:
        c = self._cache
        in_l1 = self.resident or self.in_pages
        l1 = (len(self.tokens) + c.chunk_tokens - 1) // c.chunk_tokens if in_l1 else 0
        return SessionInfo(
            session_id=self.session_id,
            tenant=self.tenant,
            state=self.state.value,
            pinned=self.pinned,
            tokens=len(self.tokens),
            bytes=len(self.tokens) * c.geometry.bytes_per_token,
            chunks_l1=l1,
            chunks_l2=counts[0],
            chunks_l3=counts[1],
            last_active=self.last_active,
        )


def as_ids(ids: torch.Tensor | Sequence[int]) -> Ids:
    """Token ids as a tuple of Python ints (`Ids`). Ids that are ints already, the usual case,
    are checked and copied in C; others (numpy or torch integers) are converted one by one,
    and anything that is not an integer raises TypeError."""
    if isinstance(ids, torch.Tensor):
        if ids.dim() == 2:
            if ids.shape[0] != 1:
                raise ValueError("kvtier sessions hold one sequence: pass a [1, T] tensor")
            ids = ids[0]
        if ids.is_floating_point() or ids.is_complex() or ids.dtype == torch.bool:
            raise TypeError(f"token ids must be integers, got a {ids.dtype} tensor")
        return tuple(ids.tolist())
    t = tuple(ids)
    kinds = set(map(type, t))
    if kinds <= {int}:
        return t
    try:
        if bool in kinds:  # a mask passed for the ids, most likely
            raise TypeError
        return tuple(operator.index(x) for x in t)
    except TypeError:
        bad = next(x for x in t if type(x) is bool or not hasattr(type(x), "__index__"))
        raise TypeError(
            f"token ids must be integers, got {type(bad).__name__} {bad!r:.40}"
        ) from None
