"""The server's listening sockets, bound before anything else starts.

uvicorn binds its address only after the app's start-up, and the app's start-up begins loading
the model and opening the cache (a new L3 root among them). A port another process holds then
failed the start only after all that. `kvtier serve` binds here first, as `loop.create_server`
would (every address the host resolves to, SO_REUSEADDR, IPv6 sockets IPv6-only), and hands the
bound sockets to uvicorn; a port that cannot be had stops the start at once, in one line.
"""

from __future__ import annotations

import contextlib
import errno
import socket

from kvtier.errors import ConfigError


class PortUnavailable(ConfigError):
    """The configured host and port cannot be bound (in use, not allowed, no such address)."""


def _where(host: str | None, port: int) -> str:
    return f"{host or '*'}:{port}"


def bind(host: str | None, port: int, backlog: int = 2048) -> list[socket.socket]:
    """Listening TCP sockets on every address `host` resolves to (all interfaces when empty),
    bound to `port`; a PortUnavailable that names the port and what to do otherwise."""
    where = _where(host, port)
    try:
        infos = socket.getaddrinfo(
            host or None, port, socket.AF_UNSPEC, socket.SOCK_STREAM, 0, socket.AI_PASSIVE
        )
    except socket.gaierror as exc:
        raise PortUnavailable(
            f"--host {host}: cannot resolve it ({exc.strerror}); pass an address of this host, "
            "such as 127.0.0.1 or 0.0.0.0"
        ) from None
    sockets: list[socket.socket] = []
    seen: set[tuple[int, object]] = set()
    try:
        for family, kind, proto, _name, address in infos:
            if (family, address) in seen:
                continue
            seen.add((family, address))
            sock = socket.socket(family, kind, proto)
            sockets.append(sock)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6 and hasattr(socket, "IPPROTO_IPV6"):
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            sock.bind(address)
            sock.listen(backlog)
            sock.setblocking(False)
    except OSError as exc:
        for sock in sockets:
            with contextlib.suppress(OSError):
                sock.close()
        raise PortUnavailable(_why(exc, where, port)) from None
    return sockets


def _why(exc: OSError, where: str, port: int) -> str:
    if exc.errno == errno.EADDRINUSE:
        return (
            f"port {port} ({where}) is already in use by another process: stop it (another "
            "kvtier serve?) or pass a free --port; nothing was loaded"
        )
    if exc.errno == errno.EACCES:
        return (
            f"port {port} ({where}) may not be bound by this user (ports below 1024 need "
            "privileges): pass a --port of 1024 or more; nothing was loaded"
        )
    if exc.errno == errno.EADDRNOTAVAIL:
        return (
            f"{where}: the address is not one of this host's; pass an address of this host to "
            "--host, such as 127.0.0.1 or 0.0.0.0; nothing was loaded"
        )
    return f"binding {where} failed: {exc.strerror or exc}; check --host and --port"
