"""What the server's routes share: `RoutePort`, the narrow face the HTTP routes see (the config,
the metrics, the engine once it is ready, readiness, the cache's snapshot for the admin
listing), and `State`, its one implementation, which the loader in kvtier.server.http.app fills in
(the engine, the warm-up, a load error). The routes of kvtier.server.http.app, completions, admin
and devices_admin take a `RoutePort`; this module imports none of them."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any, Protocol

from prometheus_client import CollectorRegistry, generate_latest

from kvtier.server.batch.engine import Engine
from kvtier.server.config import ServerConfig
from kvtier.server.http.auth import Auth
from kvtier.server.http.common import ApiError
from kvtier.server.metrics import ServerMetrics
from kvtier.snapshot import CacheSnapshot

# How long /v1/sessions waits for a fresh snapshot before it answers the previous one.
SNAPSHOT_WAIT_S = 0.05


class RoutePort(Protocol):
    """What an HTTP route may ask of the server. A route reads no loading state (the engine
    being built, the warm-up, a load error) and sets none: it asks `ready_engine` for the engine
    or gets the 503 that says why there is none."""

    config: ServerConfig
    metrics: ServerMetrics
    started: float  # the process's start (time.time())
    stop: Callable[[], None] | None  # end the process (its shutdown drains), once served

    def ready_engine(self) -> Engine: ...
    def loaded_engine(self) -> Engine | None: ...
    def readiness(self) -> tuple[int, dict[str, Any]]: ...
    def metrics_text(self) -> bytes: ...
    async def recent_snapshot(self, wait_s: float = SNAPSHOT_WAIT_S) -> tuple[Any, bool]: ...


class State:
    """The server's shared state: config, the engine once the model is loaded, metrics. The
    loader writes it; the routes see it as a `RoutePort`."""

    def __init__(self, config: ServerConfig, registry: CollectorRegistry) -> None:
        self.config = config
        self.registry = registry
        self.metrics = ServerMetrics(registry)
        self.auth = Auth.from_config(config)  # reads the API keys file, if any
        self.engine: Engine | None = None
        self.warming = False  # the in-process warm-up request runs: not ready yet
        self.load_error: BaseException | None = None
        self.fatal_error: BaseException | None = None
        self._snap_task: asyncio.Future[CacheSnapshot | None] | None = None
        self._last_snap: CacheSnapshot | None = None
        self.started = time.time()
        # Set by whatever runs the app (run.run_app): stop serving, the process is to exit.
        self.stop: Callable[[], None] | None = None

    def fatal(self, exc: BaseException) -> None:
        """An error no retry can fix: record it and stop the server, which then exits non-zero
        with the error's message (run.run_app)."""
        self.fatal_error = exc
        if self.stop is not None:
            self.stop()

    def snapshot(self) -> CacheSnapshot | None:
        """The cache's snapshot for exporters (None before the model is loaded or with no cache).
        Blocking (it takes the cache's lock): call it from a thread, never on the event loop."""
        return self.engine.backend.snapshot() if self.engine is not None else None

    async def recent_snapshot(self, wait_s: float = SNAPSHOT_WAIT_S) -> tuple[Any, bool]:
        """(snapshot, fresh) for the admin listing without blocking the event loop.

        The snapshot is taken in a thread; it waits for the cache's lock, which a restore holds
        while it loads from L3. After `wait_s` the previous snapshot is answered instead (fresh
        False), and the one in flight is shared by later calls rather than piling up threads.
        """
        if self._snap_task is None or self._snap_task.done():
            self._snap_task = asyncio.ensure_future(asyncio.to_thread(self.snapshot))
        task = self._snap_task
        if self._last_snap is not None:
            done, _ = await asyncio.wait({task}, timeout=wait_s)
            if not done:
                return self._last_snap, False
        snap = await task
        self._last_snap = snap
        return snap, True

    def loaded_engine(self) -> Engine | None:
        """The engine once the model is loaded (serving, warming up or draining), else None:
        for listings that answer before the server is ready."""
        return self.engine

    def readiness(self) -> tuple[int, dict[str, Any]]:
        """(HTTP status, body) of /readyz, before the devices are asked: 200 `ready`, or 503
        with `failed` (the device is lost), `warming`, `draining`, `loading` or `failed` (the
        model did not load)."""
        engine = self.engine
        if engine is not None and engine.fatal is not None:  # the device is lost: exiting
            return 503, {"status": "failed", "reason": str(engine.fatal)}
        if self.warming:
            return 503, {"status": "warming"}
        if engine is None or engine.draining or engine.leaving:
            why = "draining" if engine else ("failed" if self.load_error else "loading")
            body: dict[str, Any] = {"status": why}
            if engine is None and self.load_error is not None:  # exiting: say why
                body["reason"] = f"{type(self.load_error).__name__}: {self.load_error}"
            return 503, body
        return 200, {"status": "ready", "model": self.config.served_model_name}

    def metrics_text(self) -> bytes:
        """The registry in Prometheus' text format. Blocking (collectors read /proc and the
        cache): call it from a thread."""
        return generate_latest(self.registry)

    def ready_engine(self) -> Engine:
        if self.engine is None:
            if self.load_error is not None:
                raise ApiError(503, f"the model failed to load: {self.load_error}", "server_error")
            raise ApiError(
                503,
                "the model is still loading; retry shortly",
                "server_error",
                headers={"Retry-After": "1"},
            )
        if self.engine.fatal is not None:  # the device is lost: the process exits
            raise ApiError(503, f"{self.engine.fatal}; retry later", "server_error")
        if self.engine.draining:
            raise ApiError(503, "the server is shutting down; retry later", "server_error")
        return self.engine
