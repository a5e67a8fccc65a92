"""The server's view of the KV cache: restore a prefix, commit tokens, hibernate, forget.

`TieredBackend` is the real thing (kvtier.TieredCache). `RecomputeBackend` keeps nothing and
recomputes every prompt: the baseline that restores are measured against, and the reference a
test compares greedy output with. `PoolBackend` keeps K/V in the batch's page pool alone (GPU-only
prefix caching, as vLLM's automatic prefix caching does): the second baseline. Calls for one session never overlap (the server serialises
them); calls for different sessions may run on different threads.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import torch

from kvtier.cache.restore import StagedPrefix
from kvtier.cache.session import Session, as_ids
from kvtier.cache.writes import ChunkSource
from kvtier.server.config import DEFAULT_L1_BYTES, ServerConfig
from kvtier.snapshot import CacheSnapshot
from kvtier.types import RestoreSource


@dataclass
class Restored:
    """A transformers Cache covering the first `covered` tokens (never the last one), and from
    where they came. `session`: the cache's session the turn runs on (None where the backend
    keeps none); the turn's later calls pass it on (`session=`) rather than find it again."""

    kv: Any
    covered: int
    source: str  # a RestoreSource value
    session: Session | None = None


@dataclass(frozen=True)
class PrefillEstimate:
    """What the cache's cost model believes a prefill costs, and on how many measurements."""

    seconds_per_token: float
    samples: int  # 0: still the configured guess


class Backend(Protocol):
    # ids: `[1, T]`, `[T]` or a list (the cache keeps them as a list: no tensor needed).
    # session: the `Restored.session` of the turn's restore, if any (else found by its id)
    def restore(
        self, session_id: str, tenant: str, ids: torch.Tensor | Sequence[int]
    ) -> Restored: ...
    def commit(
        self,
        session_id: str,
        tenant: str,
        ids: torch.Tensor | Sequence[int],
        *,
        session: Session | None = None,
    ) -> None: ...
    def abort(self, session_id: str, tenant: str, *, session: Session | None = None) -> None: ...
    # tenant None: the sessions of that id of every tenant (admin); else only that tenant's
    def hibernate(self, session_id: str, tenant: str | None = None) -> bool: ...
    def prefetch(self, session_id: str, tenant: str | None = None) -> bool: ...
    def forget(self, session_id: str, tenant: str | None = None) -> bool: ...
    def tenants_of(self, session_id: str) -> list[str]: ...
    def shred_tenant(self, tenant: str) -> dict[str, Any]: ...
    def evict_l2(self) -> None: ...
    def on_forget(self, fn: Callable[[str, str], object]) -> None: ...
    def calibrating(self) -> contextlib.AbstractContextManager[None]: ...
    def snapshot(self) -> CacheSnapshot | None: ...
    def prefill_estimate(self) -> PrefillEstimate | None: ...
    def observe_prefill(self, tokens: int, seconds: float) -> None: ...
    def close(self) -> None: ...


@runtime_checkable
class PagedBackend(Backend, Protocol):
    """A Backend whose sessions a batch's page pool can hold as their L1 (`paged_l1`; see
    TieredBackend): the batch starts turns from its pages and commits from them."""

    def resume_pages(
        self, session_id: str, tenant: str, ids: Sequence[int], held: int
    ) -> Restored | None: ...
    def restore_staged(self, session_id: str, tenant: str, ids: Sequence[int]) -> Restored: ...
    def load_staged(
        self,
        session_id: str,
        tenant: str,
        staged: Any,
        write: Callable[[int, torch.Tensor], None],
        *,
        session: Session | None = None,
    ) -> Any: ...
    def release_staged(
        self, session_id: str, tenant: str, staged: Any, *, session: Session | None = None
    ) -> None: ...
    def pages_dropped(self, session_id: str, tenant: str) -> None: ...
    def commit_pages(
        self,
        session_id: str,
        tenant: str,
        ids: Sequence[int],
        start: int,
        chunks: Sequence[ChunkSource],
        *,
        session: Session | None = None,
    ) -> None: ...


class RecomputeBackend:
    """No cache: every request prefills its whole prompt into a fresh DynamicCache."""

    def __init__(self, model: Any) -> None:
        self._config = model.config

    def restore(self, session_id: str, tenant: str, ids: torch.Tensor | Sequence[int]) -> Restored:
        from transformers import DynamicCache

        return Restored(DynamicCache(config=self._config), 0, RestoreSource.RECOMPUTE.value)

    def commit(
        self,
        session_id: str,
        tenant: str,
        ids: torch.Tensor | Sequence[int],
        *,
        session: Session | None = None,
    ) -> None:
        return None

    def abort(self, session_id: str, tenant: str, *, session: Session | None = None) -> None:
        return None

    def hibernate(self, session_id: str, tenant: str | None = None) -> bool:
        return False

    def prefetch(self, session_id: str, tenant: str | None = None) -> bool:
        return False

    def forget(self, session_id: str, tenant: str | None = None) -> bool:
        return False

    def tenants_of(self, session_id: str) -> list[str]:
        return []

    def shred_tenant(self, tenant: str) -> dict[str, Any]:
        return {"sessions": 0, "keys": 0, "chunks": 0, "encrypted": False}  # nothing is kept

    def on_forget(self, fn: Callable[[str, str], object]) -> None:
        return None  # nothing is kept: nothing is forgotten

    def evict_l2(self) -> None:
        return None

    def calibrating(self) -> contextlib.AbstractContextManager[None]:
        return contextlib.nullcontext()

    def snapshot(self) -> CacheSnapshot | None:
        return None

    def prefill_estimate(self) -> PrefillEstimate | None:
        return None

    def observe_prefill(self, tokens: int, seconds: float) -> None:
        return None

    def close(self) -> None:
        return None


class PoolBackend(RecomputeBackend):
    """GPU-only prefix caching (`cache = "pool"`): K/V lives in the batch's page pool and
    nowhere else, as a vLLM with automatic prefix caching keeps it. A finished turn's pages park
    in the pool (paged L1 with no tier below it) and nothing is stored: no L2, no L3, no file. The
    session's next turn starts from its parked pages while they are there (source "l1", their
    tokens in the usage's `cached_tokens`); once the pool gave them to other turns it recomputes.

    The batch calls `commit_pages` when a turn's pages park and `pages_dropped` when they go;
    between the two the session is "known", which is what the admin routes act on (hibernate
    and forget free the pages)."""

    def __init__(self, model: Any) -> None:
        super().__init__(model)
        self._lock = threading.Lock()
        self._parked: set[tuple[str, str]] = set()  # (tenant, session id) with pages in the pool
        self._forgot: list[Callable[[str, str], object]] = []  # the engine's: free the pages

    def resume_pages(
        self, session_id: str, tenant: str, ids: Sequence[int], held: int
    ) -> Restored | None:
        """The parked pages hold the K/V of `ids`' first `held` tokens: the turn takes all of
        them but the prompt's last token (its logits start the reply)."""
        n = min(held, len(ids) - 1)
        return Restored(None, n, RestoreSource.L1.value) if n > 0 else None

    def restore_staged(self, session_id: str, tenant: str, ids: Sequence[int]) -> Restored:
        return Restored(None, 0, RestoreSource.RECOMPUTE.value)  # nothing below the pool

    def load_staged(
        self,
        session_id: str,
        tenant: str,
        staged: Any,
        write: Callable[[int, torch.Tensor], None],
        *,
        session: Session | None = None,
    ) -> Any:
        raise RuntimeError("the pool-only cache stages nothing: restore_staged restores nothing")

    def release_staged(
        self, session_id: str, tenant: str, staged: Any, *, session: Session | None = None
    ) -> None:
        return None

    def commit_pages(
        self,
        session_id: str,
        tenant: str,
        ids: Sequence[int],
        start: int,
        chunks: Sequence[ChunkSource],
        *,
        session: Session | None = None,
    ) -> None:
        """Nothing is gathered nor stored: the pages themselves stay, parked."""
        with self._lock:
            self._parked.add((tenant, session_id))

    def pages_dropped(self, session_id: str, tenant: str) -> None:
        with self._lock:
            self._parked.discard((tenant, session_id))

    def _known(self, session_id: str, tenant: str | None, drop: bool) -> bool:
        with self._lock:
            found = {k for k in self._parked if k[1] == session_id and tenant in (None, k[0])}
            if drop:
                self._parked -= found
        return bool(found)

    def hibernate(self, session_id: str, tenant: str | None = None) -> bool:
        return self._known(session_id, tenant, drop=True)  # the engine frees its pages

    def prefetch(self, session_id: str, tenant: str | None = None) -> bool:
        return self._known(session_id, tenant, drop=False)  # in the pool already, or nowhere

    def forget(self, session_id: str, tenant: str | None = None) -> bool:
        return self._known(session_id, tenant, drop=True)

    def tenants_of(self, session_id: str) -> list[str]:
        with self._lock:
            return sorted(t for t, sid in self._parked if sid == session_id)

    def on_forget(self, fn: Callable[[str, str], object]) -> None:
        self._forgot.append(fn)

    def shred_tenant(self, tenant: str) -> dict[str, Any]:
        """The tenant's parked pages are freed (nothing of it is stored anywhere else)."""
        with self._lock:
            gone = {k for k in self._parked if k[0] == tenant}
            self._parked -= gone
        for _, session_id in gone:
            for fn in self._forgot:
                fn(session_id, tenant)
        return {"sessions": len(gone), "keys": 0, "chunks": 0, "encrypted": False}


class TieredBackend:
    """kvtier.TieredCache behind the Backend protocol."""

    def __init__(self, model: Any, config: ServerConfig, model_id: str) -> None:
        from kvtier import CacheConfig, TieredCache
        from kvtier.tiers.l3.cap import default_max_bytes

        # Private: the KV of every conversation is as sensitive as the conversation itself.
        Path(config.l3_root).mkdir(parents=True, exist_ok=True, mode=0o700)
        self.cache = TieredCache(
            CacheConfig(
                l3_root=config.l3_root,
                l3_cold_root=config.l3_cold_root,
                # 0: the GPU memory plan's (kvtier.server.devices.memplan), or the default without one
                l1_bytes=config.l1_bytes or DEFAULT_L1_BYTES,
                l2_bytes=config.l2_bytes,
                # 0: half the filesystem that holds L3 (kvtier.tiers.l3.cap)
                l3_max_bytes=config.l3_max_bytes or default_max_bytes(Path(config.l3_root)),
                l4_url=config.l4_url or None,
                l4_ttl_s=config.l4_ttl_s,
                l4_min_idle_s=config.l4_min_idle_s,
                session_idle_s=config.session_ttl_s or None,  # 0: no bound
                max_sessions=config.max_sessions or None,
                l3_write_bound_s=config.l3_write_bound_s,
                chunk_tokens=config.chunk_tokens,
                codec=config.codec,
                write_policy=config.write_policy,
                l3_writer=config.l3_writer,
                model_id=config.model_id or model_id,
                encrypt=config.encrypt,
                master_key_file=config.master_key_file,
            ),
            model=model,
        )

    def _find(self, session_id: str, tenant: str | None = None) -> list[Any]:
        """In memory or, forgotten from it (idle), hibernated in L3."""
        return self.cache.find_sessions(session_id, tenant)

    def on_forget(self, fn: Callable[[str, str], object]) -> None:
        """`fn(session_id, tenant)` hears of each session the cache forgets from memory
        (`TieredCache.on_forget`; under its lock: it must not wait)."""
        self.cache.on_forget(fn)

    def tenants_of(self, session_id: str) -> list[str]:
        return sorted({s.tenant for s in self._find(session_id)})

    def _session(self, session_id: str, tenant: str, session: Session | None) -> Session:
        """The turn's session: the one its restore returned (`Restored.session`), else the
        cache's of that id. A session with a request running never leaves the cache's table
        (forgetting, closing and shredding pass it by), so the two are the same object; each
        call below checks the session's state under the cache's guard, as before."""
        return session if session is not None else self.cache.session(session_id, tenant=tenant)

    def restore(self, session_id: str, tenant: str, ids: torch.Tensor | Sequence[int]) -> Restored:
        s = self.cache.session(session_id, tenant=tenant)
        kv = s.restore(ids)
        return Restored(kv, int(kv.get_seq_length()), str(s.restore_source), s)

    def commit(
        self,
        session_id: str,
        tenant: str,
        ids: torch.Tensor | Sequence[int],
        *,
        session: Session | None = None,
    ) -> None:
        self._session(session_id, tenant, session).commit(ids)

    def abort(self, session_id: str, tenant: str, *, session: Session | None = None) -> None:
        self._session(session_id, tenant, session).abort()

    def resume_pages(
        self, session_id: str, tenant: str, ids: Sequence[int], held: int
    ) -> Restored | None:
        """A turn that starts from K/V a batch's page pool holds for its first `held` tokens
        (`TieredCache.resume_pages`); None when the cache does not vouch for any of them."""
        s = self.cache.session(session_id, tenant=tenant)
        n = self.cache.resume_pages(s, as_ids(ids), held)
        return Restored(None, n, RestoreSource.L1.value, s) if n else None

    def restore_staged(self, session_id: str, tenant: str, ids: Sequence[int]) -> Restored:
        """A restore whose prefix stays in L2 for the batch to copy into its pages
        (`TieredCache.restore_staged`): `kv` is the `StagedPrefix`, or a Cache when the session
        was in L1, or None with nothing restored."""
        s = self.cache.session(session_id, tenant=tenant)
        kv = self.cache.restore_staged(s, as_ids(ids))
        if isinstance(kv, StagedPrefix):
            covered = kv.tokens
        else:
            covered = 0 if kv is None else int(kv.get_seq_length())
        return Restored(kv, covered, str(s.restore_source), s)

    def load_staged(
        self,
        session_id: str,
        tenant: str,
        staged: Any,
        write: Callable[[int, torch.Tensor], None],
        *,
        session: Session | None = None,
    ) -> Any:
        """Copy a staged prefix out of L2 for `write` (`TieredCache.load_staged`); the Handle."""
        s = self._session(session_id, tenant, session)
        return self.cache.load_staged(s, staged, write)

    def release_staged(
        self, session_id: str, tenant: str, staged: Any, *, session: Session | None = None
    ) -> None:
        """Its copies are done: the staged prefix leaves L2's pins (`release_staged`)."""
        self.cache.release_staged(self._session(session_id, tenant, session), staged)

    def pages_dropped(self, session_id: str, tenant: str) -> None:
        """The batch freed the session's parked pages (`TieredCache.pages_dropped`); one
        forgotten from memory since is stored already."""
        s = self.cache.find_session(session_id, tenant)
        if s is not None:
            self.cache.pages_dropped(s)

    def commit_pages(
        self,
        session_id: str,
        tenant: str,
        ids: Sequence[int],
        start: int,
        chunks: Sequence[ChunkSource],
        *,
        session: Session | None = None,
    ) -> None:
        """Commit a turn from chunks of its pages (`TieredCache.commit_pages`)."""
        s = self._session(session_id, tenant, session)
        self.cache.commit_pages(s, as_ids(ids), start, chunks)

    def _each(self, session_id: str, tenant: str | None, op: str) -> bool:
        found = self._find(session_id, tenant)
        for s in found:
            getattr(s, op)()
        return bool(found)

    def hibernate(self, session_id: str, tenant: str | None = None) -> bool:
        return self._each(session_id, tenant, "hibernate")

    def prefetch(self, session_id: str, tenant: str | None = None) -> bool:
        return self._each(session_id, tenant, "prefetch")

    def forget(self, session_id: str, tenant: str | None = None) -> bool:
        return self._each(session_id, tenant, "close")

    def shred_tenant(self, tenant: str) -> dict[str, Any]:
        """Crypto-shred the tenant (TieredCache.shred_tenant): what was destroyed."""
        report = self.cache.shred_tenant(tenant)
        return {
            "sessions": report.sessions,
            "keys": report.keys,
            "chunks": report.chunks,
            "encrypted": report.encrypted,
        }

    def evict_l2(self) -> None:
        """Drop L2's copies of chunks durable in L3 (the next restore of them reads L3)."""
        self.cache.evict_l2()

    @contextlib.contextmanager
    def calibrating(self) -> Iterator[None]:
        """Inside: restores load every chunk they find and their timings replace the cost
        model's estimates (kvtier/cache/costmodel.py); for the start-up warm-up."""
        cost = self.cache.cost
        cost.calibrating = True
        try:
            yield
        finally:
            cost.calibrating = False

    def snapshot(self) -> CacheSnapshot | None:
        snap: CacheSnapshot = self.cache.stats()
        return snap

    def prefill_estimate(self) -> PrefillEstimate | None:
        cost = self.cache.cost  # the cache's restore cost model (kvtier/cache/costmodel.py)
        return PrefillEstimate(cost.prefill_s_per_token, int(cost.samples.get("prefill", 0)))

    def observe_prefill(self, tokens: int, seconds: float) -> None:
        """A prefill timed outside the session's Cache (the batch scheduler's forwards), which
        is how a recompute will run: the cost model's prefill estimate learns it."""
        self.cache.observe_prefill(tokens, seconds)

    def close(self) -> None:
        self.cache.close()


def make_backend(served: Any, config: ServerConfig) -> Backend:
    """The cache the config asks for; `served.name` identifies the model in chunk fingerprints."""
    if config.cache == "none":
        return RecomputeBackend(served.model)
    if config.cache == "pool":
        return PoolBackend(served.model)
    return TieredBackend(served.model, config, served.name)
