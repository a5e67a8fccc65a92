"""Clients that hold connections with unfinished bodies never lock others out (raw sockets
against a real `kvtier serve --api-keys`): a request without a key is answered 401 and its
connection closed without its body being read; a body that trickles in gets 408 once it falls
under the minimum rate; and while every regular connection is held mid-request, the reserve
still answers /healthz, /readyz and /metrics."""

from __future__ import annotations

import socket
import time
from pathlib import Path

import httpx
from server_proc import Server

from kvtier import apikeys

SMALL = ("--l1-bytes", "32MiB", "--l2-bytes", "32MiB")
CAP = 12


def _post_head(port: int, key: str | None) -> socket.socket:
    """A connection that sent a chat request's headers (a 1 MB body announced) and `{`."""
    s = socket.create_connection(("127.0.0.1", port), timeout=5)
    auth = f"Authorization: Bearer {key}\r\n" if key else ""
    s.sendall(
        (
            "POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            f"{auth}Content-Length: 1000000\r\n\r\n{{"
        ).encode()
    )
    return s


def _answer_then_closed(s: socket.socket, timeout: float) -> bytes:
    """What the server sent before closing `s` (AssertionError if it stays open)."""
    s.settimeout(timeout)
    got = b""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            chunk = s.recv(65536)
        except TimeoutError:
            break
        except OSError:  # reset: closed
            return got
        if not chunk:
            return got
        got += chunk
    raise AssertionError(f"still open after {timeout} s; got {got[:200]!r}")


def test_unauthenticated_and_trickled_bodies_never_lock_out_probes_or_clients(
    tmp_path: Path,
) -> None:
    keys = tmp_path / "keys.json"
    key = apikeys.add(keys, "alpha")[1]
    srv = Server(
        tmp_path / "l3",
        "--api-keys",
        str(keys),
        "--max-connections",
        str(CAP),
        "--probe-connections",
        "4",
        "--body-min-rate",
        "1024",
        *SMALL,
    ).start()
    headers = {"Authorization": f"Bearer {key}"}
    body = {"model": "default", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    socks: list[socket.socket] = []
    try:
        # 1. the issue's lockout: each gets its 401 and its connection closes at once
        socks = [_post_head(srv.port, None) for _ in range(CAP)]
        for s in socks:
            got = _answer_then_closed(s, 3.0)
            assert got.startswith(b"HTTP/1.1 401"), got[:100]
        r = httpx.post(srv.url + "/v1/chat/completions", json=body, headers=headers, timeout=30)
        assert r.status_code == 200, r.text

        # 2. with a key, bodies that trickle (a byte a second) hold every regular connection
        socks = [_post_head(srv.port, key) for _ in range(CAP)]
        time.sleep(0.5)  # every one of them is mid-request
        for path in ("/healthz", "/readyz", "/metrics"):  # the reserve answers the probes
            r = httpx.get(srv.url + path, timeout=5)
            assert r.status_code == 200, (path, r.status_code, r.text[:200])
        r = httpx.post(srv.url + "/v1/chat/completions", json=body, headers=headers, timeout=5)
        assert r.status_code == 503, r.text  # past the cap: the reserve is for probes
        start = time.monotonic()
        answers: dict[int, bytes] = {}
        while len(answers) < len(socks) and time.monotonic() - start < 15:
            for i, s in enumerate(socks):
                if i in answers:
                    continue
                try:
                    s.sendall(b" ")
                except OSError:  # closed by the server after its 408
                    answers[i] = _answer_then_closed(s, 2.0)
            time.sleep(1.0)
        took = time.monotonic() - start
        assert len(answers) == len(socks), f"{len(socks) - len(answers)} bodies still read"
        # the minimum rate (after its 5 s grace) ended them, not the 60 s deadline
        assert took < 12, took
        assert all(a.startswith(b"HTTP/1.1 408") for a in answers.values()), answers
        assert all(b"bytes a second" in a for a in answers.values())
        r = httpx.post(srv.url + "/v1/chat/completions", json=body, headers=headers, timeout=30)
        assert r.status_code == 200, r.text
    finally:
        for s in socks:
            s.close()
        rc = srv.stop()
    assert rc == 0, srv.output()
