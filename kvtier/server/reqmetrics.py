"""Per-request metrics as a vLLM operator reads them: responses of the /v1 endpoints by route
and status code, and each turn's latencies (end to end, queue time, time per output token,
inter-token latency) into the histograms of `kvtier.server.metrics.ServerMetrics`.

`RequestMetrics`, an ASGI middleware, counts every response of a /v1 endpoint when it ends (a
streamed one once its last chunk is sent or its client left) by route template (`endpoint`,
e.g. `/v1/sessions/{session_id}`) and status code, and notes when the request arrived.

A `TurnClock` rides on each running turn's stream (`kvtier.server.batch.jobs.Stream`): the thread
that runs the turn notes its admission and each of its tokens (one histogram observation per
token, nothing more), and the engine reads the rest once the turn has ended. The server's own
warm-up request (`kvtier.server.warm_request`) counts nowhere.
"""

from __future__ import annotations

import contextvars
import time
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from kvtier.server.warm_request import is_warm_up

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

# The endpoint label of a /v1 path that matched no route (a 404 of the router).
UNMATCHED = "unmatched"

# perf_counter when the HTTP request being served arrived (set by RequestMetrics; the route and
# the engine run in the request's task, so they see it)
_arrived: contextvars.ContextVar[float] = contextvars.ContextVar("kvtier_arrived", default=0.0)


def arrived() -> float:
    """When the HTTP request this task serves arrived (perf_counter), else now."""
    return _arrived.get() or time.perf_counter()


def endpoint_of(scope: Scope) -> str:
    """The route template the router matched (`/v1/sessions/{session_id}`), never the raw path:
    the label stays bounded."""
    path = getattr(scope.get("route"), "path", None)
    return path if isinstance(path, str) else UNMATCHED


class RequestMetrics:
    """ASGI middleware: counts each response of a /v1 endpoint (`metrics.request(endpoint,
    code)`) once it has ended, and marks the request's arrival for its turn's latencies. An
    error that escapes the app before a response started counts as the 500 it becomes."""

    def __init__(self, app: ASGIApp, metrics: Any) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not str(scope.get("path", "")).startswith("/v1/"):
            await self.app(scope, receive, send)
            return
        token = _arrived.set(time.perf_counter())
        status = 500

        async def sending(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = int(message["status"])
            await send(message)

        try:
            await self.app(scope, receive, sending)
        finally:
            _arrived.reset(token)
            if not is_warm_up(scope):
                self.metrics.request(endpoint_of(scope), status)


class TurnClock:
    """perf_counter instants of one turn: its request's arrival, its first admission (into the
    batch, or onto a worker thread), its first and last tokens, and how many it produced.

    Written by the thread that runs the turn; `ended` reads them once the turn is over. A clock
    made without metrics (the warm-up's, a bench's) observes nothing."""

    __slots__ = ("_gap", "_metrics", "admitted", "arrived", "first", "last", "tokens")

    def __init__(self, arrived: float = 0.0, metrics: Any = None) -> None:
        self.arrived = arrived
        self.admitted = 0.0
        self.first = 0.0
        self.last = 0.0
        self.tokens = 0
        self._metrics = metrics
        self._gap: Callable[[float], None] | None = (
            metrics.inter_token_seconds.observe if metrics is not None else None
        )

    @classmethod
    def start(cls, metrics: Any, internal: bool) -> TurnClock:
        """The clock of a turn starting now in the request's task: `metrics` (ServerMetrics,
        or anything else, which is not observed) unless the turn is the server's own."""
        ours = metrics if not internal and hasattr(metrics, "turn_ended") else None
        return cls(arrived(), ours)

    def admit(self, now: float) -> None:
        """The turn is admitted at `now`: its queue time ends at the first admission (a
        preempted turn is admitted again later)."""
        if not self.admitted:
            self.admitted = now

    def token(self, now: float) -> None:
        """The turn produced a token at `now`."""
        if self.tokens:
            if self._gap is not None:
                self._gap(now - self.last)
        else:
            self.first = now
        self.last = now
        self.tokens += 1

    def ended(self) -> None:
        """The turn is over (finished, cancelled or failed): observe its latencies, once."""
        metrics, self._metrics = self._metrics, None
        if metrics is not None:
            metrics.turn_ended(self)
