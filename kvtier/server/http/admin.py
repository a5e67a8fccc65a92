"""Admin routes: list, hibernate, prefetch and forget sessions; crypto-shred a tenant; drain
the host out of a fleet (`POST /admin/drain`, docs/deploy.md).

Who may call them is kvtier.server.http.auth's to say: with API keys, an admin key for every
operation, while a tenant's key lists and deletes its own sessions only (another tenant's
session answers 404, as one that does not exist); without keys, loopback peers only.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from typing import TYPE_CHECKING, Any

from fastapi import FastAPI, Request

from kvtier.errors import SessionError
from kvtier.server.batch.jobs import Overloaded
from kvtier.server.http.auth import require_admin, session_scope
from kvtier.server.http.common import MAX_SESSION_ID, MAX_TENANT, ApiError, check_id

if TYPE_CHECKING:  # pragma: no cover
    from kvtier.server.http.state import RoutePort


def install_admin_routes(app: FastAPI, state: RoutePort) -> None:
    """Add the admin routes to `app`."""

    @app.get("/v1/sessions")
    async def sessions(request: Request) -> dict[str, Any]:
        scope = session_scope(request)  # None: every tenant's sessions
        snap, fresh = await state.recent_snapshot()
        found = snap.sessions if snap is not None else ()
        data = [dataclasses.asdict(s) for s in found if scope is None or s.tenant == scope]
        engine = state.loaded_engine()
        return {
            "object": "list",
            "data": data,
            "running": engine.running if engine else 0,
            "queued": engine.waiting if engine else 0,
            # False: the cache was busy (a restore from L3 holds it); this is the last listing
            "fresh": fresh,
            "taken_at": snap.taken_at if snap is not None else None,
        }

    async def _admin(
        request: Request, session_id: str, op: str, tenant: str | None, admin_only: bool
    ) -> dict[str, Any]:
        if admin_only:
            require_admin(request)
            scope = None
        else:
            scope = session_scope(request)
        check_id(session_id, "session id", MAX_SESSION_ID)
        if tenant is not None:
            check_id(tenant, "tenant", MAX_TENANT)
        engine = state.ready_engine()
        if scope is not None:  # a tenant's key: its own session, whatever `tenant` says
            tenants = [scope] if tenant in (None, scope) else []
        elif tenant is not None:
            tenants = [tenant]
        else:  # every tenant's session of that id
            tenants = await engine.tenants_of(session_id)
        try:
            found = await engine.session_admin(session_id, tenants, op)
        except Overloaded as exc:
            raise ApiError(409, str(exc), headers={"Retry-After": str(exc.retry_after)}) from None
        if not found:
            raise ApiError(
                404,
                f"no session {session_id!r} is known to this server",
                "not_found_error",
                "session_id",
                "session_not_found",
            )
        return {"id": session_id, "object": "session", "status": op}

    @app.post("/v1/sessions/{session_id:path}/hibernate")
    async def hibernate(
        request: Request, session_id: str, tenant: str | None = None
    ) -> dict[str, Any]:
        return await _admin(request, session_id, "hibernate", tenant, admin_only=True)

    @app.post("/v1/sessions/{session_id:path}/prefetch")
    async def prefetch(
        request: Request, session_id: str, tenant: str | None = None
    ) -> dict[str, Any]:
        return await _admin(request, session_id, "prefetch", tenant, admin_only=True)

    @app.delete("/v1/sessions/{session_id:path}")
    async def forget(
        request: Request, session_id: str, tenant: str | None = None
    ) -> dict[str, Any]:
        out = await _admin(request, session_id, "forget", tenant, admin_only=False)
        return {"id": session_id, "object": "session", "deleted": True, "status": out["status"]}

    @app.post("/admin/drain")
    async def drain(request: Request, quiet_s: float = 2.0, max_wait_s: float = 60.0) -> Any:
        """Leave the fleet with every session in L4, then stop. /readyz answers 503 at once, so
        the router (HAProxy's health check) stops sending; requests keep being served until
        none has come for `quiet_s` (or `max_wait_s` passed); then running requests finish,
        every session is hibernated (L3, and L4 when the host has one: the cache's close
        waits for the queued L4 writes) and the process exits 0. The sessions' next turns,
        on the hosts that take them, restore from L4: nothing is recomputed."""
        require_admin(request)
        if not 0 <= quiet_s <= max_wait_s:
            raise ApiError(400, "quiet_s must be between 0 and max_wait_s", param="quiet_s")
        engine = state.ready_engine()
        t0 = time.monotonic()
        engine.leaving = True
        while time.monotonic() - max(t0, engine.admitted_at) < quiet_s:
            if time.monotonic() - t0 > max_wait_s:
                break
            await asyncio.sleep(0.05)
        snap, _ = await state.recent_snapshot()
        sessions = len(snap.sessions) if snap is not None else 0
        quiet = time.monotonic() - t0
        await engine.drain()  # in-flight requests finish; every session hibernated
        if state.stop is not None:
            state.stop()
        return {
            "object": "drain",
            "status": "drained",
            "sessions": sessions,
            "quiet_seconds": round(quiet, 3),
            "seconds": round(time.monotonic() - t0, 3),
        }

    @app.delete("/v1/tenants/{tenant:path}")
    async def shred_tenant(request: Request, tenant: str) -> dict[str, Any]:
        """Crypto-shred a tenant: its sessions leave L1 and L2 now, its data key and session
        records are destroyed in L3 (its chunk files are unreadable; the next gc removes
        them). Its next request recomputes."""
        require_admin(request)
        check_id(tenant, "tenant", MAX_TENANT)
        engine = state.ready_engine()
        try:
            done = await engine.shred_tenant(tenant)
        except SessionError as exc:  # one of its requests is running: retry after it
            raise ApiError(409, str(exc), headers={"Retry-After": "1"}) from None
        if not (done["sessions"] or done["keys"] or done["chunks"]):
            raise ApiError(
                404,
                f"tenant {tenant!r} has no sessions, keys or chunks here; nothing was deleted",
                param="tenant",
                code="tenant_not_found",
            )
        return {"id": tenant, "object": "tenant", "deleted": True, **done}
