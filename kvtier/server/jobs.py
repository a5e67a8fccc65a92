"""A generation request as the engine takes it (Job), the events its turn sends back to the
event loop (Started, Delta, Finished, Failed, through a Stream), and the engine's refusals."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from kvtier.errors import InvalidRequest, KvtierError


class Overloaded(KvtierError):
    """No generation slot is free within the queue timeout; retry after `retry_after` seconds."""

    def __init__(self, message: str, retry_after: int) -> None:
        super().__init__(message)
        self.retry_after = retry_after


class ContextExceeded(InvalidRequest):
    """The prompt alone does not fit in the model's context."""


class Draining(KvtierError):
    """The server is shutting down (or not ready yet) and takes no new requests."""


@dataclass
class Job:
    """One generation request, already tokenized and validated."""

    session_id: str
    tenant: str
    prompt_ids: tuple[int, ...]  # immutable: the collector untracks it (kvtier.cache.session.Ids)
    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    ephemeral: bool = False  # no session id given: forget the session after the request
    internal: bool = False  # the server's own warm-up request: it counts in no metric


@dataclass
class Started:
    source: str
    cached_tokens: int
    prompt_tokens: int


@dataclass
class Delta:
    text: str


@dataclass
class Finished:
    finish_reason: str  # "stop" | "length" | "cancelled"
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    source: str


@dataclass
class Failed:
    error: BaseException


@dataclass
class Stream:
    """Events of one running job, handed from the worker thread to the event loop."""

    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue[Any] = field(default_factory=asyncio.Queue)
    cancelled: threading.Event = field(default_factory=threading.Event)
    started: Started | None = None
    # (sinks, window) when the turn runs degraded over sinks + a window (kvtier.server.streaming)
    streaming: tuple[int, int] | None = None
    # "int8" once a step of the turn read K/V from an int8 page pool (degraded_kv)
    degraded_kv: str = "native"

    def put(self, event: Any) -> None:
        self.loop.call_soon_threadsafe(self.queue.put_nowait, event)

    def cancel(self) -> None:
        """The client went away: stop generating, keep what is committed, free L1."""
        self.cancelled.set()

    async def events(self) -> AsyncIterator[Delta | Finished]:
        while True:
            event = await self.queue.get()
            if isinstance(event, Failed):
                raise event.error
            yield event
            if isinstance(event, Finished):
                return
