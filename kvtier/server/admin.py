"""Admin routes: list, hibernate, prefetch and forget sessions; crypto-shred a tenant
(localhost only)."""

from __future__ import annotations

import asyncio
import dataclasses
from typing import TYPE_CHECKING, Any

from fastapi import FastAPI, Request

from kvtier.errors import SessionError
from kvtier.server.engine import Overloaded
from kvtier.server.http import MAX_SESSION_ID, MAX_TENANT, ApiError, check_id, local_only

if TYPE_CHECKING:  # pragma: no cover
    from kvtier.server.app import State


def install_admin_routes(app: FastAPI, state: State) -> None:
    """Add the admin routes to `app`; they answer only peers on the loopback address."""

    @app.get("/v1/sessions")
    async def sessions(request: Request) -> dict[str, Any]:
        local_only(request)
        snap, fresh = await state.recent_snapshot()
        data = [dataclasses.asdict(s) for s in snap.sessions] if snap is not None else []
        engine = state.engine
        return {
            "object": "list",
            "data": data,
            "running": engine.running if engine else 0,
            "queued": engine.waiting if engine else 0,
            # False: the cache was busy (a restore from L3 holds it); this is the last listing
            "fresh": fresh,
            "taken_at": snap.taken_at if snap is not None else None,
        }

    async def _admin(request: Request, session_id: str, op: str) -> dict[str, Any]:
        local_only(request)
        check_id(session_id, "session id", MAX_SESSION_ID)
        engine = state.ready_engine()
        try:
            lock = await engine.session_exclusive(session_id)
        except Overloaded as exc:
            raise ApiError(409, str(exc), headers={"Retry-After": str(exc.retry_after)}) from None
        try:
            fn = getattr(engine.backend, op)
            found = await asyncio.to_thread(fn, session_id)
        finally:
            engine.release(session_id, lock)
        if not found:
            raise ApiError(
                404,
                f"no session {session_id!r} is known to this server",
                "not_found_error",
                "session_id",
                "session_not_found",
            )
        return {"id": session_id, "object": "session", "status": op}

    @app.post("/v1/sessions/{session_id}/hibernate")
    async def hibernate(request: Request, session_id: str) -> dict[str, Any]:
        return await _admin(request, session_id, "hibernate")

    @app.post("/v1/sessions/{session_id}/prefetch")
    async def prefetch(request: Request, session_id: str) -> dict[str, Any]:
        return await _admin(request, session_id, "prefetch")

    @app.delete("/v1/sessions/{session_id}")
    async def forget(request: Request, session_id: str) -> dict[str, Any]:
        out = await _admin(request, session_id, "forget")
        return {"id": session_id, "object": "session", "deleted": True, "status": out["status"]}

    @app.delete("/v1/tenants/{tenant}")
    async def shred_tenant(request: Request, tenant: str) -> dict[str, Any]:
        """Crypto-shred a tenant: its sessions leave L1 and L2 now, its data key and session
        records are destroyed in L3 (its chunk files are unreadable; the next gc removes
        them). Its next request recomputes."""
        local_only(request)
        check_id(tenant, "tenant", MAX_TENANT)
        engine = state.ready_engine()
        try:
            done = await asyncio.to_thread(engine.backend.shred_tenant, tenant)
        except SessionError as exc:  # one of its requests is running: retry after it
            raise ApiError(409, str(exc), headers={"Retry-After": "1"}) from None
        return {"id": tenant, "object": "tenant", "deleted": True, **done}
