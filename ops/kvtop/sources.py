"""Where kvtop's data comes from: an HTTP endpoint, or an L3 store and the host collectors.

A source's `fetch()` returns the /metrics text and the session list (None when the source
has none) or raises `SourceError` with a message for the screen; the app keeps retrying.
"""

from __future__ import annotations

import dataclasses
import json
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from typing import Protocol

from kvtier.errors import KvtierError
from kvtier.snapshot import SessionInfo
from ops.kvtop.model import SessionList, parse_sessions

# `kvtier serve` (its default port), then `kvtier exporter` (its default port).
DEFAULT_URLS = ("http://127.0.0.1:8000", "http://127.0.0.1:9481")
TIMEOUT_S = 2.0


class SourceError(KvtierError):
    """The source cannot be read now; the message says what to check."""


@dataclasses.dataclass(frozen=True)
class Fetched:
    metrics: str
    sessions: SessionList | None
    detail: str | None = None  # why there is no session list


class Source(Protocol):
    name: str

    def fetch(self) -> Fetched: ...

    def close(self) -> None: ...


def _get(url: str, timeout: float, key: str | None = None) -> tuple[str, str]:
    headers = {"Accept": "text/plain, application/json"}
    if key:
        headers["Authorization"] = f"Bearer {key}"
    req = urllib.request.Request(url, headers=headers)
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return r.read().decode("utf-8", "replace"), r.headers.get("Content-Type", "")


class HttpSource:
    """`/metrics` and (from `kvtier serve`) `/v1/sessions` of one base URL."""

    def __init__(self, url: str, timeout: float = TIMEOUT_S, api_key: str | None = None) -> None:
        self.api_key = api_key  # for a server with --api-keys: an admin key lists every tenant
        self.base = url.rstrip("/").removesuffix("/metrics")
        if "://" not in self.base:
            self.base = "http://" + self.base
        self.name = self.base
        self.timeout = timeout

    def fetch(self) -> Fetched:
        try:
            text, _ = _get(f"{self.base}/metrics", self.timeout)
        except urllib.error.HTTPError as exc:
            raise SourceError(
                f"{self.base}/metrics answered HTTP {exc.code}; is this a kvtier serve or "
                "kvtier exporter? Use --url to point kvtop at one"
            ) from None
        except (urllib.error.URLError, OSError) as exc:
            reason = getattr(exc, "reason", exc)
            raise SourceError(
                f"cannot reach {self.base}/metrics ({reason}); start `kvtier serve` or "
                "`kvtier exporter`, or point --url at one"
            ) from None
        sessions, detail = self._sessions()
        return Fetched(text, sessions, detail)

    def _sessions(self) -> tuple[SessionList | None, str | None]:
        try:
            text, ctype = _get(f"{self.base}/v1/sessions", self.timeout, self.api_key)
        except urllib.error.HTTPError as exc:
            if exc.code == 401:
                return None, "the server wants an API key for sessions: kvtop --api-key (401)"
            if exc.code == 403:
                return None, "per-session detail answers only on localhost (403)"
            return None, f"no per-session list here (HTTP {exc.code})"
        except (urllib.error.URLError, OSError) as exc:
            return None, f"per-session list unavailable ({getattr(exc, 'reason', exc)})"
        if "json" not in ctype:
            return None, (
                "no per-session list at this endpoint (kvtier exporter); "
                "run kvtop --l3-root DIR on the host for hibernated sessions"
            )
        try:
            return parse_sessions(text), None
        except (ValueError, KeyError, TypeError) as exc:
            return None, f"per-session list unreadable: {exc}"

    def close(self) -> None:
        pass


def probe(urls: Sequence[str] = DEFAULT_URLS, timeout: float = 0.5) -> str | None:
    """The first of `urls` whose /metrics answers, or None."""
    for url in urls:
        try:
            _get(f"{url}/metrics", timeout)
            return url
        except (urllib.error.URLError, OSError):
            continue
    return None


class L3Source:
    """No server: the L3 store's index (read-only) and this host's collectors, in process."""

    def __init__(self, l3_root: str, *, nvml: bool = True) -> None:
        from ops.exporter.standalone import build

        self.registry, self.store = build(l3_root, nvml=nvml)
        self.name = f"l3-root {l3_root}"

    def fetch(self) -> Fetched:
        from prometheus_client import generate_latest

        try:
            text = generate_latest(self.registry).decode()
            records = self.store.list_sessions()
        except (OSError, KvtierError) as exc:
            raise SourceError(f"cannot read the L3 store: {exc}") from None
        except Exception as exc:  # sqlite3.Error and friends, while a writer checkpoints
            raise SourceError(f"cannot read the L3 index now ({exc}); retrying") from None
        sizes = self._chunk_sizes()
        rows = tuple(
            SessionInfo(
                session_id=r.session_id,
                tenant=r.tenant,
                state=r.state,
                pinned=r.pinned,
                tokens=r.token_count,  # also for a sealed record (encrypted store)
                bytes=sum(sizes.get(k, 0) for k in r.chunk_keys),
                chunks_l1=0,
                chunks_l2=0,
                chunks_l3=sum(1 for k in r.chunk_keys if k in sizes),
                last_active=r.last_active,
            )
            for r in records
        )
        return Fetched(text, SessionList(rows))

    def _chunk_sizes(self) -> dict[bytes, int]:
        """File bytes per chunk key, from the index (one query for every chunk)."""
        try:
            rows = self.store.index.db.execute("SELECT key, size FROM chunks")
            return {bytes(k): int(n) for k, n in rows}
        except Exception:
            return {}

    def close(self) -> None:
        self.store.close()


def dump_sessions(sessions: Sequence[SessionInfo]) -> str:
    """The `GET /v1/sessions` JSON shape for `sessions` (benchmarks and tests build lists)."""
    data = [dataclasses.asdict(s) for s in sessions]
    return json.dumps({"object": "list", "data": data, "running": 0, "queued": 0})


def now() -> float:
    return time.monotonic()
