"""The server's view of the KV cache: restore a prefix, commit tokens, hibernate, forget.

`TieredBackend` is the real thing (kvtier.TieredCache). `RecomputeBackend` keeps nothing and
recomputes every prompt: the baseline that restores are measured against, and the reference a
test compares greedy output with. Calls for one session never overlap (the server serialises
them); calls for different sessions may run on different threads.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from kvtier.snapshot import CacheSnapshot, SessionInfo
from kvtier.types import RestoreSource


@dataclass
class Restored:
    """What a restore gave back: a transformers Cache covering `covered` tokens, and from where."""

    kv: Any
    covered: int
    source: str  # a RestoreSource value


class Backend(Protocol):
    def restore(self, session_id: str, tenant: str, ids: torch.Tensor) -> Restored: ...
    def commit(self, session_id: str, tenant: str, ids: torch.Tensor) -> None: ...
    def hibernate(self, session_id: str) -> bool: ...
    def prefetch(self, session_id: str) -> bool: ...
    def forget(self, session_id: str) -> bool: ...
    def snapshot(self) -> CacheSnapshot | None: ...
    def close(self) -> None: ...


class RecomputeBackend:
    """No cache: every request prefills its whole prompt into a fresh DynamicCache."""

    def __init__(self, model: Any) -> None:
        self._config = model.config

    def restore(self, session_id: str, tenant: str, ids: torch.Tensor) -> Restored:
        from transformers import DynamicCache

        return Restored(DynamicCache(config=self._config), 0, RestoreSource.RECOMPUTE.value)

    def commit(self, session_id: str, tenant: str, ids: torch.Tensor) -> None:
        return None

    def hibernate(self, session_id: str) -> bool:
        return False

    def prefetch(self, session_id: str) -> bool:
        return False

    def forget(self, session_id: str) -> bool:
        return False

    def snapshot(self) -> CacheSnapshot | None:
        return None

    def close(self) -> None:
        return None


def _source_of(session: Any, kv: Any, covered: int) -> str:
    """The restore source the cache recorded for this restore (falls back to what is known)."""
    for attr in ("last_restore_source", "restore_source", "last_source"):
        for obj in (session, kv):
            value = getattr(obj, attr, None)
            if value is not None:
                return str(getattr(value, "value", value))
    last = getattr(session, "last_restore", None)
    if last is not None:
        src = getattr(last, "source", None)
        if src is not None:
            return str(getattr(src, "value", src))
    return RestoreSource.RECOMPUTE.value if covered == 0 else RestoreSource.L1.value


class TieredBackend:
    """kvtier.TieredCache behind the Backend protocol."""

    def __init__(self, model: Any, config: Any) -> None:
        from kvtier import CacheConfig, TieredCache

        self.cache = TieredCache(
            CacheConfig(
                l3_root=config.l3_root,
                l1_bytes=config.l1_bytes,
                l2_bytes=config.l2_bytes,
                chunk_tokens=config.chunk_tokens,
                codec=config.codec,
                write_policy=config.write_policy,
            ),
            model=model,
        )
        self._lock = threading.Lock()  # guards the name -> Session map, not the sessions
        self._sessions: dict[str, Any] = {}

    def _session(self, session_id: str, tenant: str) -> Any:
        with self._lock:
            s = self._sessions.get(session_id)
            if s is None:
                s = self.cache.session(session_id, tenant=tenant)
                self._sessions[session_id] = s
            return s

    def _known(self, session_id: str) -> Any | None:
        with self._lock:
            s = self._sessions.get(session_id)
        if s is not None:
            return s
        if any(i.session_id == session_id for i in self.sessions()):
            info = next(i for i in self.sessions() if i.session_id == session_id)
            return self._session(session_id, info.tenant)
        return None

    def restore(self, session_id: str, tenant: str, ids: torch.Tensor) -> Restored:
        s = self._session(session_id, tenant)
        kv = s.restore(ids)
        covered = int(kv.get_seq_length())
        return Restored(kv, covered, _source_of(s, kv, covered))

    def commit(self, session_id: str, tenant: str, ids: torch.Tensor) -> None:
        self._session(session_id, tenant).commit(ids)

    def hibernate(self, session_id: str) -> bool:
        s = self._known(session_id)
        if s is None:
            return False
        s.hibernate()
        return True

    def prefetch(self, session_id: str) -> bool:
        s = self._known(session_id)
        if s is None:
            return False
        s.prefetch()
        return True

    def forget(self, session_id: str) -> bool:
        s = self._known(session_id)
        if s is None:
            return False
        s.close()
        with self._lock:
            self._sessions.pop(session_id, None)
        return True

    def sessions(self) -> tuple[SessionInfo, ...]:
        return self.cache.stats().sessions

    def snapshot(self) -> CacheSnapshot | None:
        snap: CacheSnapshot = self.cache.stats()
        return snap

    def close(self) -> None:
        self.cache.close()


def make_backend(model: Any, config: Any) -> Backend:
    if config.cache == "none":
        return RecomputeBackend(model)
    return TieredBackend(model, config)
