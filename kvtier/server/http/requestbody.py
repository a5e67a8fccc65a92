"""A request's JSON body, read, decoded and validated, every failure a 4xx that says why.

A body that trickles in holds a connection, and the cap on connections counts it
(kvtier.server.http.connguard): a wait for each piece alone (`timeout`) never fires for a client
that sends a byte every few seconds. So the whole body also has a deadline (`deadline` s from
when its reading starts) and a minimum rate: after a grace of `RATE_GRACE_S`, it must have
come at `min_rate` bytes a second on average, else 408. Any error answered before the body
was read to its end closes the connection: what is left of the body is never read.
"""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

from fastapi import Request
from pydantic import BaseModel, ValidationError
from starlette.requests import ClientDisconnect

from kvtier.server.http.common import ApiError

# Seconds a body may take before the minimum rate applies (a slow start, a small first piece)
RATE_GRACE_S = 5.0
CLOSE = {"Connection": "close"}


async def read_body(
    request: Request,
    model: type[BaseModel],
    limit: int,
    timeout: float,
    deadline: float = 60.0,
    min_rate: int = 1024,
) -> Any:
    """The body as `model`: 413 past `limit` bytes; 408 when no piece of it comes for `timeout`
    seconds, when all of it has not come within `deadline` seconds, or when it comes slower
    than `min_rate` bytes a second (after `RATE_GRACE_S`); 400 when it is not UTF-8 JSON of
    that shape. The connection is closed after a 408, 413 or 415 (the body is left unread)."""
    kind = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if kind and kind != "application/json" and not kind.endswith("+json"):
        raise ApiError(
            415,
            f"request body is {kind!r}; send JSON with Content-Type: application/json",
            code="unsupported_media_type",
            headers=CLOSE,
        )
    raw = bytearray()
    stream = request.stream()
    start = time.monotonic()
    try:
        while True:
            # the next piece's wait: its own timeout, what is left of the deadline, and how
            # long what has come so far keeps the average rate at min_rate
            now = time.monotonic() - start
            by_rate = RATE_GRACE_S + len(raw) / min_rate - now if min_rate else timeout
            wait = min(timeout, deadline - now, by_rate)
            try:
                if wait <= 0:
                    raise asyncio.TimeoutError
                chunk = await asyncio.wait_for(anext(stream), wait)
            except StopAsyncIteration:
                break
            except asyncio.TimeoutError:
                raise _slow(wait == timeout, timeout, deadline, min_rate) from None
            except ClientDisconnect:  # no one hears the answer; it must not be a 500
                raise ApiError(400, "the client closed the connection during the body") from None
            raw += chunk
            if len(raw) > limit:
                raise ApiError(
                    413, f"request body is larger than {limit} bytes; send less text", headers=CLOSE
                )
    finally:
        await stream.aclose()
    try:
        text = bytes(raw).decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ApiError(
            400, f"request body is not valid UTF-8 (byte {exc.start}); encode the JSON as UTF-8"
        ) from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ApiError(400, f"request body is not valid JSON: {exc}") from None
    except RecursionError:
        raise _too_deep() from None
    if not isinstance(data, dict):
        raise ApiError(400, "request body must be a JSON object")
    try:
        return model.model_validate(data)
    except RecursionError:
        raise _too_deep() from None
    except ValidationError as exc:
        err = exc.errors()[0]
        where = ".".join(str(p) for p in err["loc"])
        if err["type"] == "extra_forbidden":
            known = ", ".join(sorted(model.model_fields))
            msg = f"unknown field {where!r}; this server accepts: {known}"
        else:
            msg = f"{where}: {err['msg']}"
        raise ApiError(400, msg, param=where or None) from None


def _slow(stalled: bool, timeout: float, deadline: float, min_rate: int) -> ApiError:
    if stalled:
        why = f"no part of the request body came for {timeout:g} s"
    else:
        why = (
            f"the request body did not come within {deadline:g} s, at {min_rate} bytes a second "
            "at least"
        )
    return ApiError(408, f"{why}; send the whole body at once", headers=CLOSE)


def _too_deep() -> ApiError:
    return ApiError(400, "request body nests arrays or objects too deeply; send a flatter JSON")
