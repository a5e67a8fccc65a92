"""Noticing that the client of a non-streamed request went away while its turn runs.

A streamed response notices at its next write, and its turn is cancelled there (app.py). A
non-streamed one writes nothing until the turn is done, so without a watch its turn ran to
`max_tokens` for no one (7.65 s in one report), and the session's next request waited behind
it. `watch` listens on the request's ASGI receive channel, which says `http.disconnect` once the
connection is closed (its body has been read by then, so nothing else comes on it).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable

from fastapi import Request

# A server whose channel answers at once with something else is polled at this period
POLL_S = 0.05


async def until_gone(request: Request) -> None:
    """Return once the client has disconnected."""
    while True:
        message = await request.receive()
        if message.get("type") == "http.disconnect":
            return
        await asyncio.sleep(POLL_S)


def watch(request: Request, on_gone: Callable[[], None]) -> asyncio.Task[None]:
    """Call `on_gone` when the client disconnects; cancel the task returned once the response
    is ready (it is sent, or its client has gone)."""

    async def run() -> None:
        with contextlib.suppress(Exception):  # a channel that fails: no watch, as before
            await until_gone(request)
            on_gone()

    return asyncio.ensure_future(run())
