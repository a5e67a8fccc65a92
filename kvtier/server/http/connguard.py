"""Connections that hold the server without sending a request: a header timeout, a cap on open
connections and the process's open-files limit.

uvicorn closes an idle keep-alive connection (`timeout_keep_alive`), but a connection that never
finishes its request line and headers stays open for good: its keep-alive timer is cancelled by
the first byte, and a fresh connection has none. Enough of them use up the process's file
descriptors, and then `/healthz` and every other request go unanswered (`accept` fails with
EMFILE). Per server, with one ConnectionGuard:

- `guarded_protocol`, uvicorn's h11 protocol with a header timeout: a connection gets
  `header_timeout` seconds from when it opens (or from the first byte of a follow-up request on
  a kept-alive connection) to complete the request's headers, else it is closed;
- `guarded_listener`, the listening socket with a cap on open connections, applied as each one
  is accepted (asyncio accepts a burst of them before any reaches a protocol): past
  `max_connections`, a new connection closes the one that has waited longest for a request's
  headers (else the longest idle keep-alive one); when every connection is mid-request, or too
  many closes are still under way, the new one takes one of `reserve` connections kept for
  the probes (`/healthz`, `/readyz`, `/metrics`), else gets 503 and is closed;
- `probes_only`, the app behind the reserve: while more than `max_connections` are open, a
  request for any other path gets 503 (and its connection closes), so a probe is answered
  however many clients hold connections mid-request.

`raise_open_files` sets the process's soft RLIMIT_NOFILE at start (`max_open_files`), and
`connection_cap` derives the automatic cap from it, leaving a reserve for the cache's files.
"""

from __future__ import annotations

import contextlib
import logging
import socket
import time
from typing import Any

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from kvtier.errors import ConfigError

log = logging.getLogger("kvtier.server")

# The automatic cap (`max_connections` 0) at most: each connection costs memory too
MAX_AUTO_CONNECTIONS = 10_000
# `max_open_files` 0 with an unlimited hard limit: raise the soft limit to this
UNLIMITED_OPEN_FILES = 65_536
# How often the log says how many connections were closed unfinished (at most)
REPORT_EVERY_S = 60.0

_REFUSED = (
    b"HTTP/1.1 503 Service Unavailable\r\ncontent-type: text/plain; charset=utf-8\r\n"
    b"connection: close\r\ncontent-length: 25\r\n\r\ntoo many open connections"
)


class ConnectionGuard:
    """What one server's connections share: how many are open, those waiting for a request's
    headers and those idle between requests (each oldest first), and what was closed."""

    def __init__(self, header_timeout: float, max_connections: int, reserve: int = 0) -> None:
        self.header_timeout = header_timeout
        self.max_connections = max_connections
        self.reserve = reserve  # connections past the cap for the probes' paths alone
        # connections closed for new ones whose files are not released yet, at most: past it a
        # new connection is refused, so the files in use stay under max_connections + this
        self.slack = eviction_slack(max_connections)
        self.open = 0  # connections with a protocol, until it is told the connection is lost
        self.pending = 0  # accepted, the protocol not made yet
        self.closing = 0  # closed by the guard, the protocol not told yet
        self.reading: dict[Any, None] = {}  # insertion-ordered: oldest first
        self.idle: dict[Any, None] = {}
        self.closed = {"header_timeout": 0, "evicted": 0, "refused": 0}
        self._reported = dict(self.closed)
        self._last_report = 0.0

    def admit(self) -> bool:
        """Whether a connection just accepted may stay: under the cap, or at it when an older
        connection waiting for a request is closed for it."""
        files = self.open + self.pending
        if files - self.closing >= self.max_connections:
            victim = self.oldest() if files < self.max_connections + self.slack else None
            if victim is not None:
                self.count("evicted")
                victim.close_waiting()
            elif files - self.closing >= self.max_connections + self.reserve:
                self.count("refused")
                return False
        self.pending += 1
        return True

    @property
    def over_cap(self) -> bool:
        """More connections are open than `max_connections`: the reserve is in use."""
        return self.open - self.closing > self.max_connections

    def oldest(self) -> Any | None:
        """The connection to close for a new one: the longest wait for headers, else the
        longest idle keep-alive; None when every connection is mid-request."""
        for waiting in (self.reading, self.idle):
            if waiting:
                return next(iter(waiting))
        return None

    def count(self, reason: str) -> None:
        self.closed[reason] += 1
        now = time.monotonic()
        if now - self._last_report >= REPORT_EVERY_S:
            new = {
                k: v - self._reported[k] for k, v in self.closed.items() if v > self._reported[k]
            }
            log.warning(
                "closed connections that sent no complete request: %s (header_timeout %.3g s, "
                "max_connections %d)",
                ", ".join(f"{n} {k}" for k, n in new.items()),
                self.header_timeout,
                self.max_connections,
            )
            self._reported = dict(self.closed)
            self._last_report = now


def guarded_protocol(guard: ConnectionGuard) -> type[H11Protocol]:
    """uvicorn's h11 protocol, closing connections by `guard`'s header timeout, and telling it
    which connections wait for a request (the ones the cap may close)."""

    class GuardedH11Protocol(H11Protocol):
        _header_timer: Any = None
        _closing = False

        def connection_made(self, transport: Any) -> None:  # type: ignore[override]
            guard.pending = max(0, guard.pending - 1)
            guard.open += 1
            super().connection_made(transport)
            self._await_headers()

        def data_received(self, data: bytes) -> None:
            if self._header_timer is None and self.conn.their_state is h11.IDLE:
                self._await_headers()  # the first byte of a follow-up request
            super().data_received(data)
            if self.conn.their_state is not h11.IDLE:
                self._headers_done()
            elif self._header_timer is None and not self.transport.is_closing():
                # the rest of a body answered before it was read, maybe the start of the next
                # request after it: uvicorn arms no keep-alive timer for that, so this one runs
                self._await_headers()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            if not self.transport.is_closing() and self.conn.their_state is h11.IDLE:
                guard.idle[self] = None  # kept alive: uvicorn's keep-alive timer runs

        def connection_lost(self, exc: Exception | None) -> None:
            self._headers_done()
            guard.idle.pop(self, None)
            guard.open -= 1
            if self._closing:
                guard.closing -= 1
            super().connection_lost(exc)

        def _await_headers(self) -> None:
            guard.idle.pop(self, None)
            guard.reading[self] = None
            self._header_timer = self.loop.call_later(guard.header_timeout, self._timed_out)

        def _headers_done(self) -> None:
            guard.reading.pop(self, None)
            if self._header_timer is not None:
                self._header_timer.cancel()
                self._header_timer = None

        def _timed_out(self) -> None:
            self._header_timer = None
            if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
                guard.count("header_timeout")
                self.close_waiting()

        def close_waiting(self) -> None:
            """Close this connection, which has no request in progress (nothing to answer)."""
            self._headers_done()
            guard.idle.pop(self, None)
            if not self._closing:
                self._closing = True
                guard.closing += 1
            if self.conn.our_state is h11.IDLE:
                self.conn.send(h11.ConnectionClosed())
            self.transport.close()

    return GuardedH11Protocol


class _Listener(socket.socket):
    """A listening socket whose accept() keeps only the connections `guard` admits."""

    guard: ConnectionGuard

    def accept(self) -> tuple[socket.socket, Any]:
        while True:  # BlockingIOError once no connection waits: asyncio's "none left"
            conn, address = super().accept()
            if self.guard.admit():
                return conn, address
            with contextlib.suppress(OSError):
                conn.setblocking(False)
                conn.send(_REFUSED)
            conn.close()


def probes_only(app: Any, guard: ConnectionGuard, probes: frozenset[str]) -> Any:
    """`app` (ASGI), answering 503 to any request but for the `probes` paths while the
    guard's reserve is in use (`guard.over_cap`); the connection then closes."""

    async def guarded(scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "http" and scope["path"] not in probes and guard.over_cap:
            guard.count("refused")
            await send(
                {
                    "type": "http.response.start",
                    "status": 503,
                    "headers": [
                        (b"content-type", b"text/plain; charset=utf-8"),
                        (b"connection", b"close"),
                        (b"retry-after", b"1"),
                    ],
                }
            )
            await send({"type": "http.response.body", "body": b"too many open connections"})
            return
        await app(scope, receive, send)

    return guarded


def guarded_listener(sock: socket.socket, guard: ConnectionGuard) -> socket.socket:
    """`sock`, a bound listening socket, as one whose connections `guard` caps (`sock` is
    detached: use the socket returned)."""
    listener = _Listener(sock.family, sock.type, sock.proto, fileno=sock.detach())
    listener.guard = guard
    return listener


def raise_open_files(wanted: int) -> int:
    """Set the soft open-files limit: to `wanted`, or with 0 to the hard limit; the limit now.

    ConfigError when `wanted` is above the hard limit (raising that needs privileges)."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if wanted:
        if hard != resource.RLIM_INFINITY and wanted > hard:
            raise ConfigError(
                f"max_open_files: {wanted} is above this process's hard limit of {hard} open "
                f"files; ask for at most {hard}, or raise the hard limit (ulimit -Hn, "
                "LimitNOFILE= in a systemd unit)"
            )
        target = wanted
    else:
        target = UNLIMITED_OPEN_FILES if hard == resource.RLIM_INFINITY else hard
        if soft != resource.RLIM_INFINITY and soft >= target:
            return int(soft)
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
    except (ValueError, OSError) as exc:  # a kernel cap below the hard limit (nr_open)
        if wanted:
            raise ConfigError(f"max_open_files: cannot set {wanted}: {exc}") from None
        log.warning("could not raise the open-files limit to %d: %s", target, exc)
        return int(soft)
    return target


def eviction_slack(max_connections: int) -> int:
    """Connections closed for new ones whose files may still be held: an eighth of the cap."""
    return max(1, max_connections // 8)


def connection_cap(max_connections: int, open_files: int) -> int:
    """`max_connections`, or with 0 the automatic cap for an `open_files` limit: what is left
    after a reserve for the cache's and the model's files (a quarter of the limit, at most
    1,024) and for the closes still under way in a burst (`eviction_slack`)."""
    usable = open_files - min(open_files // 4, 1024)
    if max_connections:
        if max_connections + eviction_slack(max_connections) > usable:
            log.warning(
                "max_connections %d: with %d open files, that many connections can leave the "
                "cache and the model without files (EMFILE); lower it, or raise max_open_files",
                max_connections,
                open_files,
            )
        return max_connections
    return max(1, min(MAX_AUTO_CONNECTIONS, usable * 8 // 9))
