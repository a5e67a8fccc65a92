"""Connections that never finish their headers must not take the server down: the header timeout
closes them, the cap on open connections keeps file descriptors for the requests that do come,
and the open-files limit is set at start (kvtier.server.http.connguard)."""

from __future__ import annotations

import resource
import socket
import time
from pathlib import Path

import httpx
import pytest
from server_proc import Server

from kvtier.errors import ConfigError
from kvtier.server.config import ServerConfig
from kvtier.server.http.connguard import (
    MAX_AUTO_CONNECTIONS,
    ConnectionGuard,
    connection_cap,
    eviction_slack,
    raise_open_files,
)

SMALL = ("--l1-bytes", "32MiB", "--l2-bytes", "32MiB")
PARTIAL = b"GET /healthz HTTP/1.1\r\nHost: x\r\n"  # the headers' blank line never comes
HEADER_TIMEOUT = 2.0


def _closed(sock: socket.socket) -> bool:
    """Whether the server has closed `sock` (EOF or reset); it sends nothing on these."""
    try:
        return sock.recv(64) == b""
    except BlockingIOError:
        return False
    except OSError:
        return True


def _wait_closed(socks: list[socket.socket], timeout: float) -> list[socket.socket]:
    """The sockets still open after up to `timeout` seconds."""
    for s in socks:
        s.setblocking(False)
    left = list(socks)
    deadline = time.monotonic() + timeout
    while left and time.monotonic() < deadline:
        left = [s for s in left if not _closed(s)]
        time.sleep(0.05)
    return left


def test_half_open_connections_past_the_fd_limit_are_closed_and_healthz_answers(
    tmp_path: Path,
) -> None:
    # 256 open files (soft and hard, as `ulimit -n 256` sets them), 300 connections that never
    # finish their headers: before the guard, accept() failed with EMFILE and /healthz hung
    srv = Server(
        tmp_path / "l3",
        "--header-timeout",
        str(HEADER_TIMEOUT),
        *SMALL,
        open_files=256,
    ).start()
    socks: list[socket.socket] = []
    try:
        opened = time.monotonic()
        for _ in range(300):
            s = socket.create_connection(("127.0.0.1", srv.port), timeout=5)
            s.sendall(PARTIAL)
            socks.append(s)
        for _ in range(3):
            t = time.perf_counter()
            r = httpx.get(srv.url + "/healthz", timeout=5)
            assert r.status_code == 200
            assert time.perf_counter() - t < 1.0
        left = _wait_closed(socks, HEADER_TIMEOUT + 3.0)
        assert not left, f"{len(left)} of 300 half-open connections still open"
        assert time.monotonic() - opened < HEADER_TIMEOUT + 3.0
        assert httpx.get(srv.url + "/readyz", timeout=5).status_code == 200
    finally:
        for s in socks:
            s.close()
        rc = srv.stop()
    assert rc == 0, srv.output()
    assert "Too many open files" not in srv.output()


def test_a_kept_alive_connection_that_stalls_in_its_next_headers_is_closed(
    tmp_path: Path,
) -> None:
    srv = Server(tmp_path / "l3", "--header-timeout", "1", "--max-open-files", "300", *SMALL)
    srv.start()
    try:
        pid = srv.proc.pid if srv.proc else 0
        limits = Path(f"/proc/{pid}/limits").read_text()
        line = next(x for x in limits.splitlines() if x.startswith("Max open files"))
        assert line.split()[3] == "300", line  # the soft limit, as --max-open-files set it
        with socket.create_connection(("127.0.0.1", srv.port), timeout=5) as s:
            s.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
            assert s.recv(4096).startswith(b"HTTP/1.1 200")
            time.sleep(0.5)
            s.sendall(b"GET /healthz HTTP/1.1\r\n")  # a follow-up request that stalls
            assert not _wait_closed([s], 3.0)
    finally:
        assert srv.stop() == 0, srv.output()


def test_connection_cap_leaves_files_to_the_cache() -> None:
    for files in (256, 1024, 4096, 20000):
        cap = connection_cap(0, files)
        # the connections and the closes a burst leaves under way stay inside what the cache's
        # and the model's quarter (at most 1,024 files) leaves
        assert 0 < cap + eviction_slack(cap) <= files - min(files // 4, 1024)
    assert connection_cap(0, 1024) == 682  # `ulimit -n 1024`
    assert connection_cap(0, 1_048_576) == MAX_AUTO_CONNECTIONS
    assert connection_cap(100, 1024) == 100  # given: as given


def test_the_cap_closes_the_longest_wait_for_headers_first_and_bounds_files() -> None:
    guard = ConnectionGuard(10.0, max_connections=2)

    class Conn:
        closed = False

        def close_waiting(self) -> None:  # as the protocol's: no longer waiting, closing
            self.closed = True
            guard.reading.pop(self, None)
            guard.idle.pop(self, None)
            guard.closing += 1

    idle, reading = Conn(), Conn()
    guard.open = 2
    guard.idle[idle] = None  # kept alive between requests
    guard.reading[reading] = None  # still sending its headers
    assert guard.admit()  # at the cap: the one waiting for headers goes, not the idle one
    assert reading.closed and not idle.closed
    # its file is not released until the loop runs its close: no more than the slack meanwhile
    assert guard.slack == 1 and not guard.admit()
    assert not idle.closed and guard.closed["refused"] == 1
    guard.open, guard.closing, guard.pending = 2, 0, 0  # closed; the new one has its protocol
    assert guard.admit() and idle.closed  # then the idle one
    guard.open, guard.closing, guard.pending = 2, 0, 0
    assert not guard.admit()  # every connection is mid-request: the new one is refused
    assert guard.closed == {"header_timeout": 0, "evicted": 2, "refused": 2}


def test_max_open_files_above_the_hard_limit_is_refused() -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY:
        pytest.skip("no hard limit on open files here")
    with pytest.raises(ConfigError, match="hard limit"):
        raise_open_files(hard + 1)
    assert resource.getrlimit(resource.RLIMIT_NOFILE) == (soft, hard)  # left as it was


def test_connection_settings_are_checked() -> None:
    config = ServerConfig.load(
        flags={"header_timeout": "2.5", "max_connections": "64"},
        env={"KVTIER_KEEP_ALIVE_TIMEOUT": "30", "KVTIER_MAX_OPEN_FILES": "4096"},
    )
    assert (config.header_timeout, config.max_connections) == (2.5, 64)
    assert (config.keep_alive_timeout, config.max_open_files) == (30.0, 4096)
    for bad in (
        {"header_timeout": 0},
        {"body_timeout": -1},
        {"keep_alive_timeout": 0},
        {"max_connections": -1},
        {"max_open_files": -5},
    ):
        with pytest.raises(ConfigError):
            ServerConfig(**bad)  # type: ignore[arg-type]
