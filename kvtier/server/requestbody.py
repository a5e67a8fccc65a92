"""A request's JSON body, read, decoded and validated, every failure a 4xx that says why."""

from __future__ import annotations

import asyncio
import json
from typing import Any

from fastapi import Request
from pydantic import BaseModel, ValidationError
from starlette.requests import ClientDisconnect

from kvtier.server.http import ApiError


async def read_body(request: Request, model: type[BaseModel], limit: int, timeout: float) -> Any:
    """The body as `model`: 413 past `limit` bytes, 408 when no piece of it comes for `timeout`
    seconds (the connection is then closed), 400 when it is not UTF-8 JSON of that shape."""
    kind = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if kind and kind != "application/json" and not kind.endswith("+json"):
        raise ApiError(
            415,
            f"request body is {kind!r}; send JSON with Content-Type: application/json",
            code="unsupported_media_type",
        )
    raw = bytearray()
    stream = request.stream()
    try:
        while True:
            try:
                chunk = await asyncio.wait_for(anext(stream), timeout)
            except StopAsyncIteration:
                break
            except asyncio.TimeoutError:
                raise ApiError(
                    408,
                    f"no part of the request body came for {timeout:g} s; send the whole body "
                    "at once",
                    headers={"Connection": "close"},
                ) from None
            except ClientDisconnect:  # no one hears the answer; it must not be a 500
                raise ApiError(400, "the client closed the connection during the body") from None
            raw += chunk
            if len(raw) > limit:
                raise ApiError(413, f"request body is larger than {limit} bytes; send less text")
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


def _too_deep() -> ApiError:
    return ApiError(400, "request body nests arrays or objects too deeply; send a flatter JSON")
