"""One streamed chat completion through the whole app, in process, before the server is ready.

The engine's warm-up (kvtier.server.batch.engine) runs the model's paths: kernels, graphs, the cache.
What it cannot reach is the rest of a request's way: the HTTP route, the scheduler thread's
first turn (admission, sampling, delivery of events) and the streamed response. On an H200 the
first request after every start paid 13-20 ms there (2-3x a recompute of its prompt), and only
the first. This request pays it instead, before /readyz says ready.

It is an ASGI call made here, not a connection: the scope carries WARM_UP_EXTENSION, which an
ASGI server never sets from a client's request, and the request runs as the warm-up tenant,
which no client can name, on an ephemeral session (forgotten after the turn).
"""

from __future__ import annotations

import asyncio
import json
import logging
from typing import Any

log = logging.getLogger("kvtier.server")

WARM_UP_EXTENSION = "kvtier.warm_up"
# Short: under the scheduler's prefill sample size (512), so the cost model learns nothing from
# this first, slower turn; the kernels of longer prompts were warmed by the engine.
WARM_UP_TEXT = "Warm-up: list the tools, then say ready. " * 6


def is_warm_up(scope: Any) -> bool:
    """Whether this request is the in-process warm-up request."""
    return bool((scope.get("extensions") or {}).get(WARM_UP_EXTENSION) is not None)


async def warm_request(app: Any, model: str, path: str = "/v1/chat/completions") -> float:
    """Send the warm-up request to `app`; the seconds it took. Raises RuntimeError when the
    response is not a complete 200 stream (the caller logs it and serves anyway)."""
    body = json.dumps(
        {
            "model": model,
            "messages": [{"role": "user", "content": WARM_UP_TEXT}],
            "max_tokens": 2,
            "temperature": 0,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
    ).encode()
    scope: dict[str, Any] = {
        "type": "http",
        "asgi": {"version": "3.0", "spec_version": "2.3"},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": path,
        "raw_path": path.encode(),
        "query_string": b"",
        "root_path": "",
        "headers": [
            (b"host", b"warm-up"),
            (b"content-type", b"application/json"),
            (b"content-length", str(len(body)).encode()),
        ],
        "client": None,
        "server": None,
        "extensions": {WARM_UP_EXTENSION: {}},
        "state": {},
    }
    sent = False
    done = asyncio.Event()
    status: list[int] = []
    chunks: list[bytes] = []

    async def receive() -> dict[str, Any]:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        await done.wait()  # the client stays until the response is complete
        return {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        if message["type"] == "http.response.start":
            status.append(int(message["status"]))
        elif message["type"] == "http.response.body":
            chunks.append(bytes(message.get("body", b"")))
            if not message.get("more_body", False):
                done.set()

    loop = asyncio.get_running_loop()
    started = loop.time()
    await app(scope, receive, send)
    text = b"".join(chunks).decode(errors="replace")
    if status != [200] or "data: [DONE]" not in text:
        raise RuntimeError(f"status {status[:1]}: {text[-300:]}")
    return loop.time() - started
