"""A generation request as the engine takes it (Job), the events its turn sends back to the
event loop (Started, Delta, Finished, Failed, through a Stream), and the engine's refusals."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

from kvtier.errors import ContextExceeded, InvalidRequest, KvtierError
from kvtier.server.config import ServerConfig
from kvtier.server.reqmetrics import TurnClock

# The warm-up's session: '#' is outside what clients may send as a session id or tenant
# (kvtier.server.http.common._ID), so no client's session can ever be this one.
WARM_UP_SESSION = "#warm-up"
WARM_UP_TENANT = "#kvtier"


class Overloaded(KvtierError):
    """No generation slot is free within the queue timeout; retry after `retry_after` seconds."""

    def __init__(self, message: str, retry_after: int) -> None:
        super().__init__(message)
        self.retry_after = retry_after


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
    # the end-of-sequence token does not end the reply (vLLM's ignore_eos): it runs to
    # max_tokens, a stop string or the context's end (kvtier.server.decoding.sampling.ReplyText)
    ignore_eos: bool = False
    internal: bool = False  # the server's own warm-up request: it counts in no metric
    # what the turn does to its logits (kvtier.server.decoding.logitproc): penalties, the top ids to
    # report with each token (None: no logprobs), and a new grammar matcher per turn (None:
    # unconstrained; kvtier.server.decoding.grammar)
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logprobs: int | None = None
    grammar: Callable[[], Any] | None = None


@dataclass
class Started:
    source: str
    cached_tokens: int
    prompt_tokens: int


@dataclass
class Delta:
    text: str
    # the logprobs of the tokens whose text this delta completes (kvtier.server.decoding.logitproc)
    logprobs: list[Any] | None = None


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
    # (sinks, window) when the turn runs degraded over sinks + a window (kvtier.server.devices.streaming)
    streaming: tuple[int, int] | None = None
    # "int8" once the turn was admitted into an int8 page pool (degraded_kv): its steps read int8
    # K/V from then on
    degraded_kv: str = "native"
    # its arrival, admission and tokens, for the latency histograms (kvtier.server.reqmetrics)
    clock: TurnClock = field(default_factory=TurnClock)

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


def check_fits(
    served: Any, config: ServerConfig, prompt_tokens: int, max_tokens: int | None
) -> int:
    """The max_tokens to use, or InvalidRequest that says by how much the request is too long."""
    context = served.context_tokens
    if prompt_tokens < 1:
        raise InvalidRequest("the prompt is empty; send at least one token of text")
    if prompt_tokens >= context:
        raise ContextExceeded(
            f"the prompt has {prompt_tokens} tokens but the model's context is {context}; "
            "shorten the conversation (drop or summarise old turns)"
        )
    room = context - prompt_tokens
    limit = min(room, config.max_tokens_limit)
    if max_tokens is None:
        return limit
    if max_tokens > limit:
        raise InvalidRequest(
            f"max_tokens={max_tokens} is too large: at most {limit} here (context {context}, "
            f"prompt {prompt_tokens} tokens, server limit {config.max_tokens_limit})"
        )
    return max_tokens
