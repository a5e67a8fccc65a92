"""Device admin routes of a model placed across devices (loopback only):

- `GET /v1/admin/devices`: the placement and the failover state;
- `POST /v1/admin/devices/{n}/fail`: treat device n as lost (drain, re-place its layers on the
  survivors, rebuild the page pool, resume every session); answers once serving again;
- `POST /v1/admin/devices/{n}/restore`: device n is back; its layers return to it.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Any

from fastapi import FastAPI, Request

from kvtier.errors import ConfigError
from kvtier.placement import DeviceLost
from kvtier.server.http import ApiError, local_only

if TYPE_CHECKING:  # pragma: no cover
    from kvtier.server.app import State
    from kvtier.server.failover import DeviceFailover

# Longest wait for a failover or restore to be applied (it waits for the current step).
APPLY_TIMEOUT_S = 120.0


def install_device_routes(app: FastAPI, state: State) -> None:
    def failover(request: Request) -> DeviceFailover:
        local_only(request)
        engine = state.ready_engine()
        devices = engine.served.devices
        if devices is None:
            raise ApiError(
                404,
                "this server runs its model on one device; start it with --devices to place "
                "layers across devices",
                "not_found_error",
                code="no_placement",
            )
        return devices  # type: ignore[no-any-return]

    @app.get("/v1/admin/devices")
    async def devices(request: Request) -> dict[str, Any]:
        return failover(request).status()

    async def _apply(request: Request, n: int, op: str) -> dict[str, Any]:
        fo = failover(request)
        reason = f"failed by the operator ({request.client.host if request.client else '?'})"
        try:
            fut = fo.fail(n, reason) if op == "fail" else fo.restore(n)
            result: dict[str, Any] = await asyncio.to_thread(fut.result, APPLY_TIMEOUT_S)
        except (ConfigError, DeviceLost) as exc:
            raise ApiError(409, str(exc), code="device_state") from None
        return result

    @app.post("/v1/admin/devices/{n}/fail")
    async def fail(request: Request, n: int) -> dict[str, Any]:
        return await _apply(request, n, "fail")

    @app.post("/v1/admin/devices/{n}/restore")
    async def restore(request: Request, n: int) -> dict[str, Any]:
        return await _apply(request, n, "restore")
