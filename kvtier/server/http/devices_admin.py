"""Device admin routes of a model placed across devices (loopback only):

- `GET /v1/admin/devices`: the placement and the failover state;
- `POST /v1/admin/devices/{n}/fail`: treat device n as lost (drain, re-place its layers on the
  survivors, rebuild the page pool, resume every session); answers once serving again. Device
  n may be the primary: the primary role (embeddings, LM head, the batch, the session L1) moves
  to a survivor. The last device left cannot be failed (409);
- `POST /v1/admin/devices/{n}/restore`: device n is back; its layers (and the primary role,
  when it was the home primary) return to it;

and what /readyz and each response say while degraded (`device_readiness`, `DegradedTurn`).
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from kvtier.errors import ConfigError
from kvtier.placement import DeviceLost
from kvtier.server.http.auth import require_admin
from kvtier.server.http.common import ApiError

if TYPE_CHECKING:  # pragma: no cover
    from kvtier.server.devices.failover import DeviceFailover
    from kvtier.server.http.state import RoutePort

# Longest wait for a failover or restore to be applied (it waits for the current step).
APPLY_TIMEOUT_S = 120.0
# "1" when the server was degraded (a device lost, its layers on the survivors) as the turn began
DEGRADED_HEADER = "X-Kvtier-Degraded"
# set when the turn ran over attention sinks + a sliding window (kvtier.server.devices.streaming)
STREAMING_HEADER = "X-Kvtier-Streaming-Attention"
# "int8" when the page pool stored K/V as int8 (degraded_kv) as the turn began
DEGRADED_KV_HEADER = "X-Kvtier-Degraded-KV"


def device_readiness(devices: DeviceFailover | None, model: str) -> JSONResponse | None:
    """/readyz while a device is lost: 200 "degraded" with the reason (503 "failed" when every
    device is lost); None when every device is healthy (or there is one device)."""
    if devices is None or not devices.degraded:
        return None
    if devices.state == "failed":
        body = {"status": "failed", "reason": devices.reason, "model": model}
        return JSONResponse(body, status_code=503)
    body = {"status": "degraded", "device_state": devices.state, "reason": devices.reason}
    return JSONResponse({**body, "model": model})


class DegradedTurn:
    """What one turn's response says about degraded serving: headers at its start, the usage
    field and the metrics at its end."""

    def __init__(
        self, devices: Any, streaming: tuple[int, int] | None, metrics: Any, stream: Any = None
    ) -> None:
        self.devices = devices
        self.streaming = streaming
        self.metrics = metrics
        self.stream = stream  # its `degraded_kv` turns "int8" once it runs in int8 pages
        self.at_start = devices is not None and devices.degraded
        pool = getattr(getattr(devices, "scheduler", None), "pool", None)
        self.int8_at_start = self.at_start and bool(getattr(pool, "quantized", False))
        if streaming is not None:
            metrics.count("streaming_turns")

    @property
    def degraded(self) -> bool:
        """Degraded at its start or now."""
        return self.at_start or (self.devices is not None and self.devices.degraded)

    def headers(self) -> dict[str, str]:
        """Nothing on a server with one device; with --devices, whether it began degraded."""
        if self.devices is None:
            return {}
        out = {DEGRADED_HEADER: "1" if self.at_start else "0"}
        if self.streaming is not None:
            sinks, window = self.streaming
            out[STREAMING_HEADER] = f"sinks={sinks}, window={window}"
        if self.int8_at_start:
            out[DEGRADED_KV_HEADER] = "int8"
        return out

    @property
    def kv(self) -> str:
        """ "int8" when some of the turn's K/V was read from an int8 page pool, else "native"."""
        ran = getattr(self.stream, "degraded_kv", "native")
        return "int8" if self.int8_at_start or ran == "int8" else "native"

    def finished(self) -> None:
        if self.degraded:
            self.metrics.count("degraded_turns")
        if self.kv == "int8":
            self.metrics.count("int8_kv_turns")


def install_device_routes(app: FastAPI, state: RoutePort) -> None:
    def failover(request: Request) -> DeviceFailover:
        require_admin(request)
        engine = state.ready_engine()
        devices = engine.devices
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
